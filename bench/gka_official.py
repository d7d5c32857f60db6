"""The official Gated KalmaNet code's own paths against ncd and a float64 per-token recurrence of the paper's
equations (issue 33, item 4): which one follows the paper, on the same inputs; and the official forward's time.

The official code (awslabs/hybrid-model-factory, its `training/src`) and, optionally, an fla source tree are read
from checkouts outside this repository (or an ignored folder carried to the GPU host), never copied into it:

    python3 bench/gka_official.py --hmf /tmp/hmf/training/src [--fla /tmp/fla_full] [--t 48] [--phase both]

Phases:
- `official` runs the official one-step decoding path (`torch_decoding_one_step`: its Chebyshev decode kernel,
  then fla's `fused_recurrent_simple_gla`) token by token, and its chunked forward (`gka_chebyshev_gla`), and
  saves the outputs. The official kernels use block pointers, which Triton 3.9's interpreter removed: on a CPU run
  this phase needs Triton 3.6 on PYTHONPATH (e.g. `pip install --target /tmp/t36 triton==3.6.0`).
- `compare` computes ncd's chunked op (IEEE products and the default) and the float64 recurrence
  (`ncd.families.recurrence.reference.naive_gka`) and prints the relative RMS and worst-token errors of each output
  against the recurrence.
- `both`: the two in one process (a GPU with Triton 3.6, or an interpreter where both run); `--bf16` draws bf16
  q, k, v.
- `time` (GPU): the official chunked forward against ncd's `chunk_gka` forward at B 4, H 8, D 128, bf16, `--ts`
  and `--rs` (do_bench medians).

`--fla` (a checkout or an unpacked wheel, e.g. fla 0.5.0 beside an installed 0.6.0) is imported without its
package `__init__`s, which import every op, some of which do not import under a CPU Triton; without it the
installed fla is used. On the CPU, fla's `fused_recurrent_simple_gla` kernel fails in Triton 3.6's interpreter (a
loop bound read as an array): `--torch-gla-step` then replaces it with its one-token math in fp32 torch
(h <- exp(g) h + k^T v, o = scale q h: fla's common/fused_recurrent.py). The official Chebyshev decode kernel still
runs as written. hmf's own package `__init__`s (the training stack) are bypassed too.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import types
from pathlib import Path


def _import_official(hmf: str, fla: str | None, torch_gla_step: bool):
    """The official Chebyshev ops without the packages above them (hmf's `__init__`s import the training stack).
    `fla`: a checkout or unpacked wheel to use instead of the installed fla, imported without its `__init__`s."""
    sys.path[:0] = [hmf] + ([fla] if fla else [])
    packages = [("hmf", "hmf"), ("hmf.model", "hmf/model"), ("hmf.model.hybrid_zoo", "hmf/model/hybrid_zoo"),
                ("hmf.model.hybrid_zoo.layers", "hmf/model/hybrid_zoo/layers"),
                ("hmf.model.hybrid_zoo.layers.gated_kalmanet", "hmf/model/hybrid_zoo/layers/gated_kalmanet")]
    packages = [(name, f"{hmf}/{path}") for name, path in packages]
    if fla:
        packages += [("fla", f"{fla}/fla"), ("fla.ops", f"{fla}/fla/ops")]
    for name, path in packages:
        module = types.ModuleType(name)  # the package without its __init__
        module.__path__ = [path]
        module.__version__ = "checkout"  # type: ignore[attr-defined]
        sys.modules[name] = module
    import triton.runtime.autotuner as autotuner

    if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter cannot benchmark configs: keep the first
        init = autotuner.Autotuner.__init__

        def first_config(self, fn, arg_names, configs, *args, **kwargs):
            init(self, fn, arg_names, configs[:1], *args, **kwargs)

        autotuner.Autotuner.__init__ = first_config  # type: ignore[method-assign]
    from hmf.model.hybrid_zoo.layers.gated_kalmanet.ops.chebyshev import gka_chebyshev_solve as official

    if torch_gla_step:
        official.fused_recurrent_simple_gla = _gla_step
    return official


def _gla_step(q, k, v, scale, g, initial_state, output_final_state):
    """One token of fla's fused_recurrent_simple_gla in fp32 torch: state [B, H, K, V]."""
    import torch

    decay = g[:, 0, :, None, None].float().exp()
    h = initial_state.float() * decay + k[:, 0, :, :, None].float() * v[:, 0, :, None, :].float()
    o = scale * torch.einsum("bhk,bhkv->bhv", q[:, 0].float(), h)[:, None]
    return o.to(v.dtype), h


def inputs(T: int, H: int, D: int, device: str, batch: int = 1, dtype=None):
    """The bench's distribution (bench/gka.py `draw`): unit q, k; g = logsigmoid(randn + 3); beta, alpha sigmoids.
    q, k, v in `dtype` (default fp32); gates, beta and alpha fp32."""
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)
    q = F.normalize(torch.randn(batch, T, H, D, generator=gen), dim=-1)
    k = F.normalize(torch.randn(batch, T, H, D, generator=gen), dim=-1)
    v = torch.randn(batch, T, H, D, generator=gen)
    g = F.logsigmoid(torch.randn(batch, T, H, generator=gen) + 3.0)
    beta = torch.sigmoid(torch.randn(batch, T, H, generator=gen))
    alpha = torch.sigmoid(torch.randn(batch, T, H, generator=gen))
    q, k, v = (t.to(dtype or torch.float32) for t in (q, k, v))
    return [t.to(device) for t in (q, k, v, g, beta, alpha)]


def run_official(official, x, scale: float, ridge: float, r: int, chunk: int) -> dict:
    """The official layer's core on `x`: it scales k and v by (beta + 1e-6) before the core (GKA/gka.py)."""
    import torch

    q, k, v, g, beta, alpha = x
    kb, vb = _scaled(k, v, beta)
    B, T, H, D = q.shape
    h_kk = torch.zeros(B, H, D, D, device=q.device)
    h_kv = torch.zeros(B, H, D, D, device=q.device)
    steps = []
    for t in range(T):
        one = [y[:, t:t + 1].contiguous() for y in (q, kb, vb, alpha, g)]
        o, h_kk, h_kv = official.torch_decoding_one_step(*one, one[-1], scale, ridge, "chebyshev", r, h_kk, h_kv)
        steps.append(o)
    out = {"decode": torch.cat(steps, 1)}
    try:
        # alpha in q's dtype, as the official layer makes it (an fp32 alpha promotes q to fp32, and fla's output
        # kernel then refuses fp32 q against a bf16 state)
        out["chunked"] = official.gka_chebyshev_gla(q, kb, vb, alpha.to(q.dtype), g, g, scale, ridge, "chebyshev",
                                                    r, True, chunk)[0]
    except Exception as err:  # fla's chunk kernels in an interpreter that cannot run them: say so, go on
        print(f"official chunked forward did not run here: {type(err).__name__}: {str(err)[-1500:]}")
    return out


def _scaled(k, v, beta):
    """k and v scaled by beta + 1e-6 in their own dtype, as the official layer does before its core."""
    return (k * (beta[..., None] + 1e-6)).to(k.dtype), (v * (beta[..., None] + 1e-6)).to(v.dtype)


def compare(outputs: dict, x, scale: float, ridge: float, r: int, chunk: int) -> None:
    from ncd.families.recurrence.reference import naive_gka
    from ncd.ops import chunk_gka

    q, k, v, g, beta, alpha = x
    ref, _ = naive_gka(*(t.double() for t in x), scale=scale, ridge=ridge, num_iter=r)
    ours = {}
    for name, config in (("ncd chunked (ieee products)", {"dot_precision": "ieee"}), ("ncd chunked", None)):
        ours[name] = chunk_gka(q, k, v, g, beta, scale, alpha=alpha, ridge=ridge, num_iter=r, chunk_size=chunk,
                               config=config)[0]
    rows = {**{f"official {name}": o for name, o in outputs.items()}, **ours}
    print(f"T {q.shape[1]}, H {q.shape[2]}, D {q.shape[3]}, {q.dtype} inputs, {r} Chebyshev steps, ridge {ridge}, "
          f"chunk {chunk}; error against the float64 per-token recurrence of the paper's equations:")
    for name, o in rows.items():
        diff = (o.to(ref.device).double() - ref)
        worst = float((diff.norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)).max())
        print(f"  {name:30s} rel RMS {float(diff.norm() / ref.norm()):.2e}   worst token {worst:.2e}", flush=True)


def time_forwards(official, ts: list[int], rs: list[int], batch: int, heads: int, dim: int) -> None:
    """do_bench medians (ms) of the official core's chunked forward (`gka_chebyshev_gla` on k, v already scaled by
    beta: the scaling is left out of its time) and ncd's `chunk_gka` forward (which scales inside), bf16 inputs."""
    import torch

    print(f"\n| T | r | official fwd ms | ncd fwd ms | official / ncd |  (B {batch}, H {heads}, D {dim}, bf16, "
          f"{torch.cuda.get_device_name()})\n|---|---|---|---|---|")
    for t in ts:
        x = inputs(t, heads, dim, "cuda", batch, torch.bfloat16)
        for r in rs:
            theirs, ours = _time_shape(official, x, r, dim ** -0.5)
            print(f"| {t} | {r} | {theirs:.3f} | {ours:.3f} | {theirs / ours:.2f}x |", flush=True)
        del x
        torch.cuda.empty_cache()


def _time_shape(official, x, r: int, scale: float) -> tuple[float, float]:
    from triton.testing import do_bench

    from ncd.ops import chunk_gka

    q, k, v, g, beta, alpha = x
    kb, vb = _scaled(k, v, beta)
    alpha_q = alpha.to(q.dtype)  # as the official layer makes it (see run_official)
    theirs = do_bench(lambda: official.gka_chebyshev_gla(q, kb, vb, alpha_q, g, g, scale, 0.02, "chebyshev", r, True,
                                                         64), return_mode="median")
    ours = do_bench(lambda: chunk_gka(q, k, v, g, beta, scale, alpha=alpha, num_iter=r), return_mode="median")
    return theirs, ours


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hmf", required=True, help="the official repository's training/src")
    parser.add_argument("--fla", help="an fla checkout or unpacked wheel (the directory holding fla/); default: the "
                        "installed fla")
    parser.add_argument("--phase", choices=("official", "compare", "both", "time"), default="both")
    parser.add_argument("--t", type=int, default=48)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=16)
    parser.add_argument("--bf16", action="store_true", help="bf16 q, k, v (default fp32)")
    parser.add_argument("--ts", default="2048,8192,16384", help="--phase time: sequence lengths (B 4, H 8, D 128)")
    parser.add_argument("--rs", default="10,30", help="--phase time: Chebyshev steps")
    parser.add_argument("--store", default="/tmp/gka_official.pt")
    parser.add_argument("--torch-gla-step", action="store_true")
    args = parser.parse_args()
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.phase == "time":
        official = _import_official(args.hmf, args.fla, args.torch_gla_step)
        time_forwards(official, [int(t) for t in args.ts.split(",")], [int(r) for r in args.rs.split(",")], 4, 8, 128)
        return
    x = inputs(args.t, args.heads, args.dim, device, dtype=torch.bfloat16 if args.bf16 else torch.float32)
    scale, ridge, r = args.dim ** -0.5, 0.02, 30
    if args.phase in ("official", "both"):
        official = _import_official(args.hmf, args.fla, args.torch_gla_step)
        start = time.time()
        outputs = run_official(official, x, scale, ridge, r, args.chunk)
        torch.save(outputs, args.store)
        print(f"official paths: {sorted(outputs)} in {time.time() - start:.0f} s -> {args.store}")
    if args.phase in ("compare", "both"):
        compare(torch.load(Path(args.store)), x, scale, ridge, r, args.chunk)


if __name__ == "__main__":
    main()
