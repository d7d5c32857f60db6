"""Where the time of a variant's forward+backward goes: CUDA time per kernel, ncd against FlexAttention, one table per
(variant, N), from torch.profiler over a few calls after warm-up (GPU only; the variants and shapes of
bench/attention_variants.py). NCD's tuning log (stderr) names the configs it picked.

    python3 bench/profile_variants.py --cases causal:4096,prefix_lm:4096,document:16384

`--tiles dkdv=64,128,8,3/32,64,4,3 --tiles dq=...` replaces the tiles one kernel of ncd tunes over (kinds: fwd, dkdv,
dq, dq_ds), to measure tiles before they go into AttentionConfig; each tuned kernel's every tile time is printed
(a changed tile list is a tuning entry of its own: the tuning file never answers for it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import flex_attention

sys.path.insert(0, str(Path(__file__).resolve().parent))
import attention_variants as av
from gka import kernel_times  # CUDA time per kernel, torch.profiler

CALLS = 5


KERNELS = {"fwd": "fwd_kernel", "dkdv": "bwd_dkdv_kernel", "dq": "bwd_dq_kernel", "dq_ds": "bwd_dq_ds_kernel"}


def retile(kernels, tiles: dict[str, str]) -> None:
    """Replace the configs of the named kernels' autotuners (`m,n,warps,stages/...`)."""
    from ncd.families.attention.kernel import tile_configs
    for kind, text in tiles.items():
        tuple_tiles = tuple(tuple(int(x) for x in t.split(",")) for t in text.split("/"))
        getattr(kernels, KERNELS[kind]).configs = tile_configs(kind, tuple_tiles)


def tile_times(kernels) -> None:
    for kind, attr in KERNELS.items():
        timings = getattr(getattr(kernels, attr), "configs_timings", None) or {}
        for config, ms in sorted(timings.items(), key=lambda kv: kv[1][0] if isinstance(kv[1], list) else kv[1]):
            ms = ms[0] if isinstance(ms, list) else ms
            kw = config.kwargs
            print(f"  {kind:6s} {kw['BLOCK_M']:4d} x {kw['BLOCK_N']:<4d} w{config.num_warps} s{config.num_stages}"
                  f" h{kw.get('HEADS_FAST', 0)}: {ms:.3f} ms")


def case(name: str, n: int, flex, tiles: dict[str, str]) -> None:
    variant = av.VARIANTS[name]
    shape = av.Shape(batch=max(1, 32768 // n), heads=16, n=n, window=256, device="cuda")
    q, k, v, do = av._inputs(variant, shape, seed=n)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    ex = variant.inputs(shape, torch.Generator().manual_seed(n))
    op = av.load(variant, print).op
    retile(op.module.KERNELS, tiles)
    kwargs = av.ncd_kwargs(op, ex)
    score_mod, _ = av.flex_mods(variant, ex)
    bm = av.block_mask(variant, ex, shape)
    if variant.prologue is None and variant.sink is None:
        def theirs(q_, k_, v_):
            return flex(q_, k_, v_, score_mod=score_mod, block_mask=bm, scale=variant.scale)
    else:
        theirs = torch.compile(av.flex_form(variant, ex, score_mod, bm, flex_attention), dynamic=False)
    for label, fn in (("ncd", lambda: op(q, k, v, **kwargs).backward(do)),
                      ("flex", lambda: theirs(q, k, v).backward(do))):
        rows = sorted(((kernel[:70], us) for kernel, (us, _) in kernel_times(fn, CALLS).items()), key=lambda r: -r[1])
        print(f"\n## {name} N={n} B={shape.batch} {label}: total {sum(t for _, t in rows):.0f} us")
        for kernel, us in rows[:8]:
            print(f"  {us:9.1f} us  {kernel}")
    tile_times(op.module.KERNELS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="causal:4096,prefix_lm:4096")
    parser.add_argument("--tiles", action="append", default=[], help="KIND=m,n,warps,stages/... (repeatable)")
    args = parser.parse_args()
    flex = torch.compile(flex_attention, dynamic=False)
    for item in args.cases.split(","):
        name, n = item.split(":")
        case(name, int(n), flex, dict(t.split("=", 1) for t in args.tiles))


if __name__ == "__main__":
    main()
