"""GPU benchmark of the recurrence family's linear recurrences (issue 33), one run per op: correctness first, then
timings against fla (fla-core wheel). --op simple_gla (specs/simple_gla.ncd; fla's chunk_simple_gla,
fused_recurrent_simple_gla), gla (specs/gla.ncd, a gate per key; chunk_gla, fused_recurrent_gla),
gated_delta_rule (specs/gated_delta_rule.ncd; chunk_gated_delta_rule, fused_recurrent_gated_delta_rule) or
delta_rule (specs/delta_rule.ncd; chunk_delta_rule, fused_recurrent_delta_rule).

Correctness: ncd's output, final state and every gradient (q, k, v, g, beta, initial state) against the float64
per-token recurrence at B 2, T 300 (chunk 64: T not a multiple of it), fp32 and bf16 inputs; fla's beside it (bf16).
Timings (bf16, do_bench medians, ms): forward and forward+backward at B 4, T 2k-16k, H 8 and 16, D 128; decoding
one token at B 32, H 16, D 128 from an fp32 state, as a fraction of the bandwidth needed to read and write the
state once (measured against a device-to-device copy of the same bytes in the same run).

    cd /tmp && python3 /path/to/repo/bench/recurrence.py [--op simple_gla] [--ts 2048,4096,8192,16384] [--hs 8,16]
Prints a short table last; rows go to $OUT/recurrence-<op>.json when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench, do_bench_cudagraph

import ncd
from ncd.families.recurrence.reference import naive_delta_rule, naive_simple_gla
from ncd.ops import shipped_spec

D = 128
FLA_BACKWARD = False  # set by main: whether fla's gated backward runs here (it refuses Hopper with Triton < 3.7.1)
# per op: its inputs after q, k, v; the float64 reference (inputs..., initial state) -> (o, S_T); fla's functions
OPS = {
    "simple_gla": (("g",), lambda q, k, v, g, s0: naive_simple_gla(q, k, v, g, initial_state=s0),
                   "fla.ops.simple_gla", ("chunk_simple_gla", "fused_recurrent_simple_gla")),
    "gla": (("gk",), lambda q, k, v, g, s0: naive_simple_gla(q, k, v, g, initial_state=s0),
            "fla.ops.gla", ("chunk_gla", "fused_recurrent_gla")),
    "gated_delta_rule": (("g", "beta"), lambda q, k, v, g, b, s0: naive_delta_rule(q, k, v, b, g, initial_state=s0),
                         "fla.ops.gated_delta_rule", ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule")),
    "delta_rule": (("beta",), lambda q, k, v, b, s0: naive_delta_rule(q, k, v, b, initial_state=s0),
                   "fla.ops.delta_rule", ("chunk_delta_rule", "fused_recurrent_delta_rule")),
}
OP = "simple_gla"  # set by main


def ms(fn, rep=100):
    return float(do_bench(fn, warmup=10, rep=rep, return_mode="median"))


def graph_ms(fn):
    fn()  # compile and tune outside the graph
    return float(do_bench_cudagraph(fn, rep=100, return_mode="median"))


def draw(b, t, h, dtype, seed):
    """q, k, v and the op's extra inputs: log gates <= 0, beta in (0, 1); unit keys for the delta rules (fla's
    layers normalise them: the update contracts then), keys scaled by D^-1/2 for simple GLA."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, t, h, D, device="cuda", generator=gen).to(dtype)
    k = torch.randn(b, t, h, D, device="cuda", generator=gen)
    k = (F.normalize(k, dim=-1) if "delta" in OP else k * D ** -0.5).to(dtype)
    v = torch.randn(b, t, h, D, device="cuda", generator=gen).to(dtype)
    g = F.logsigmoid(torch.randn(b, t, h, device="cuda", generator=gen) + 3.0)
    beta = torch.sigmoid(torch.randn(b, t, h, device="cuda", generator=gen))
    gk = F.logsigmoid(torch.randn(b, t, h, D, device="cuda", generator=gen)) / 16  # fla's GLA layer's gates
    extra = {"g": g, "beta": beta, "gk": gk}
    return (q, k, v, *(extra[name] for name in OPS[OP][0]))


def rms(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())


def gradients(fn, inputs, do, dfinal):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    o, final = fn(*leaves)
    grads = torch.autograd.grad((o, final), leaves, (do, dfinal))
    return [o, final, *grads]


def check(module, fla, failures, input_backward):
    extra, reference = OPS[OP][:2]
    n_in = 3 + len(extra)
    names = ["o", "S_T", "dq", "dk", "dv", *(f"d{e}" for e in extra), "dS_0"]
    for dtype, limit in ((torch.float32, 1e-4), (torch.bfloat16, 5e-3)):
        inputs = draw(2, 300, 2, dtype, seed=1)
        s0 = torch.randn(2, 2, D, D, device="cuda") * 0.1
        do = torch.randn_like(inputs[2])
        dfin = torch.randn_like(s0)
        ref = gradients(reference, [x.double() for x in (*inputs, s0)], do.double(), dfin.double())

        def call(fn):
            return lambda *t: fn(*t[:n_in], initial_state=t[n_in], output_final_state=True)

        got = gradients(call(module.chunk), (*inputs, s0), do, dfin)
        errs = [rms(a, b) for a, b in zip(got, ref, strict=True)]
        line = ", ".join(f"{n} {e:.1e}" for n, e in zip(names, errs, strict=True))
        bad = [n for n, e in zip(names, errs, strict=True) if not e <= limit]
        verdict = f"FAIL {bad}" if bad else "OK"
        print(f"  ncd vs fp64 recurrence ({str(dtype)[6:]}): {line} (limit {limit:g}) {verdict}")
        failures += [f"{dtype} {n}" for n in bad]
        if dtype == torch.bfloat16:  # the backward with the inputs' 16-bit products (grad_precision="input")
            fast = gradients(call(input_backward.chunk), (*inputs, s0), do, dfin)
            print("  ncd, bf16 backward products, vs fp64: " + ", ".join(
                f"{n} {rms(a, b):.1e}" for n, a, b in zip(names, fast, ref, strict=True)))
        if fla is not None and dtype == torch.bfloat16:  # fla at fp32 autotunes for minutes on a fresh machine
            try:
                theirs = call(fla[0])(*inputs, s0)
            except (AssertionError, RuntimeError) as error:  # fla's chunk_delta_rule refuses fp32
                print(f"  fla ({str(dtype)[6:]}): {str(error)[:100]}")
                continue
            print(f"  fla vs fp64 recurrence ({str(dtype)[6:]}): " + ", ".join(
                f"{n} {rms(a, b):.1e}" for n, a, b in zip(names[:2], theirs, ref[:2], strict=True)))
            if FLA_BACKWARD:
                theirs = gradients(call(fla[0]), (*inputs, s0), do, dfin)
                print(f"  fla gradients vs fp64 ({str(dtype)[6:]}): " + ", ".join(
                    f"{n} {rms(a, b):.1e}" for n, a, b in zip(names[2:], theirs[2:], ref[2:], strict=True)))
    # decoding continues a chunked prefill
    inputs = draw(2, 130, 2, torch.bfloat16, seed=3)
    whole, _ = module.chunk(*inputs, output_final_state=True)
    _, state = module.chunk(*(x[:, :129] for x in inputs), output_final_state=True)
    one, _ = module.recurrent(*(x[:, 129:] for x in inputs), initial_state=state)
    err = rms(one, whole[:, 129:])
    print(f"  decoding after a chunked prefill vs the chunked op: {err:.1e} {'OK' if err < 1e-2 else 'FAIL'}")
    if not err < 1e-2:
        failures.append("decode")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ts", default="2048,4096,8192,16384")
    parser.add_argument("--hs", default="8,16")
    parser.add_argument("--check-only", action="store_true")
    parser.add_argument("--fwd-only", action="store_true", help="time the forward only")
    parser.add_argument("--skip-check", action="store_true",
                        help="timings only (the check's fla calls autotune for minutes)")
    parser.add_argument("--op", default="simple_gla", choices=sorted(OPS))
    args = parser.parse_args()
    global OP
    OP = args.op
    op = ncd.load(shipped_spec(OP))
    module, input_backward = op.module, op.with_config(grad_precision="input").module
    try:
        import importlib

        fla_module = importlib.import_module(OPS[OP][2])
        fla = tuple(getattr(fla_module, name) for name in OPS[OP][3])
    except ImportError as error:
        print(f"fla not importable ({error}): ncd alone")
        fla = None
    print(f"{OP}: device {torch.cuda.get_device_name()}, torch {torch.__version__}")
    if fla is not None:
        global FLA_BACKWARD
        try:
            x = [t.requires_grad_() for t in draw(1, 64, 1, torch.bfloat16, 0)]
            fla[0](*x)[0].sum().backward()
            FLA_BACKWARD = True
        except RuntimeError as error:
            print(f"fla's backward does not run here: {str(error)[:160]}")
    failures: list[str] = []
    if not args.skip_check:
        check(module, fla, failures, input_backward)
    rows = []
    if not args.check_only:
        for heads in map(int, args.hs.split(",")):
            for t in map(int, args.ts.split(",")):
                inputs = draw(4, t, heads, torch.bfloat16, seed=t)
                leaves = [x.detach().clone().requires_grad_() for x in inputs]
                do = torch.randn_like(inputs[2])
                row = {"B": 4, "T": t, "H": heads}

                def fwdbwd(fn, leaves=leaves, do=do):
                    o = fn(*leaves)[0]
                    torch.autograd.grad(o, leaves, do)

                row["ncd fwd"] = ms(lambda: module.chunk(*inputs))  # noqa: B023
                if not args.fwd_only:
                    row["ncd f+b"] = ms(lambda: fwdbwd(module.chunk))
                    row["ncd f+b bf16 bwd"] = ms(lambda: fwdbwd(input_backward.chunk))
                if fla is not None:
                    row["fla fwd"] = ms(lambda: fla[0](*inputs))  # noqa: B023
                if FLA_BACKWARD and not args.fwd_only:
                    row["fla f+b"] = ms(lambda: fwdbwd(fla[0]))
                rows.append(row)
                print(row, flush=True)
        # decoding: B 32, H 16, one token, fp32 state in and out
        b, heads = 32, 16
        inputs = draw(b, 1, heads, torch.bfloat16, seed=5)
        state = torch.randn(b, heads, D, D, device="cuda")
        copy_out = torch.empty_like(state)
        with torch.no_grad():  # device time (CUDA graphs: no host time), and the host-inclusive call time
            row = {"decode B": b, "H": heads,
                   "ncd": graph_ms(lambda: module.recurrent(*inputs, initial_state=state)),
                   "ncd call": ms(lambda: module.recurrent(*inputs, initial_state=state)),
                   "copy": graph_ms(lambda: copy_out.copy_(state))}
            if fla is not None:
                row["fla"] = graph_ms(lambda: fla[1](*inputs, initial_state=state, output_final_state=True))
                row["fla call"] = ms(lambda: fla[1](*inputs, initial_state=state, output_final_state=True))
        row["state MB"] = state.numel() * 4 / 1e6
        rows.append(row)
        print(row)
    print("\n| shape | ncd fwd | fla fwd | fwd ratio | ncd f+b | ncd f+b, bf16 bwd | fla f+b | f+b ratio |")
    print("|---|---|---|---|---|---|---|---|")
    nan = float("nan")
    for row in rows:
        if "T" in row:
            fla_fwd, fla_fb = row.get("fla fwd", nan), row.get("fla f+b", nan)
            ncd_fb = row.get("ncd f+b", nan)
            print(f"| B4 T{row['T']} H{row['H']} | {row['ncd fwd']:.3f} | {fla_fwd:.3f} | "
                  f"{fla_fwd / row['ncd fwd']:.2f}x | {ncd_fb:.3f} | {row.get('ncd f+b bf16 bwd', nan):.3f} | "
                  f"{fla_fb:.3f} | {fla_fb / ncd_fb:.2f}x |")
        else:
            gbs = 2 * row["state MB"] / row["ncd"]  # MB / ms = GB/s
            print(f"decode B32 H16 1 token, device time: ncd {row['ncd'] * 1e3:.1f} us ({gbs:.0f} GB/s; a copy of "
                  f"the same bytes {row['copy'] * 1e3:.1f} us: {row['copy'] / row['ncd']:.0%} of it), fla "
                  f"fused_recurrent {row.get('fla', nan) * 1e3:.1f} us; per call with host time: ncd "
                  f"{row['ncd call'] * 1e3:.1f} us, fla {row.get('fla call', nan) * 1e3:.1f} us")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"recurrence-{OP}.json"), "w") as f:
            json.dump({"rows": rows, "failures": failures}, f, indent=1)
    print("FAILURES: " + ", ".join(failures) if failures else "all checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
