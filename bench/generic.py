"""What the generic family costs: its op (a PyTorch function of the spec's IR, torch.compile'd) against the same
function written by hand in PyTorch and torch.compile'd the same way, forward and forward + backward.

    python bench/generic.py                      # GPU: Inductor, realistic sizes, fp32
    python bench/generic.py --dtype bf16         # bf16 inputs (both sides compute in fp32, as the generic op does)
    python bench/generic.py --device cpu --quick # smoke test without a GPU (aot_eager, tiny sizes)

The hand-written functions compute exactly what the specs say, in the generic op's precision (inputs upcast to
float32, outputs cast back), so the ratio is the price of building the function from the IR (the extra
reshapes, the generic normalize's masked-row guard, the call-time checks) and nothing else. Each side is called
once before timing (compilation), then timed with triton.testing.do_bench on CUDA (median of its reps) or a
perf_counter loop on the CPU. Prints one ratio table (generic / hand; below 1 means the generic op is faster).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import ncd

SPECS = Path(__file__).resolve().parent.parent / "specs"


def rmsnorm_matmul(x, g, W):
    x32 = x.float()
    n = x32 / torch.sqrt(x32.square().sum(-1, keepdim=True) / x32.shape[-1] + 1e-6) * g.float()
    return (n @ W.float()).to(x.dtype)


def swiglu_mlp(x, Wg, Wu, Wd):
    x32 = x.float()
    gate, up = x32 @ Wg.float(), x32 @ Wu.float()
    return ((F.silu(gate) * up) @ Wd.float()).to(x.dtype)


def channel_softmax(x):
    return torch.softmax(x.float(), dim=1).to(x.dtype)


# spec -> (hand-written function, sizes at full scale, sizes for --quick)
CASES = {
    "rmsnorm_matmul": (rmsnorm_matmul, {"row": 8192, "dim": 4096, "hid": 4096}, {"row": 33, "dim": 17, "hid": 9}),
    "swiglu_mlp": (swiglu_mlp, {"row": 4096, "dim": 2048, "hid": 5632}, {"row": 33, "dim": 17, "hid": 23}),
    "channel_softmax": (channel_softmax, {"batch": 16, "chan": 150, "pix": 128 * 128},
                        {"batch": 3, "chan": 11, "pix": 65}),
}


def timed(fn, device: str, reps: int) -> float:
    """Milliseconds per call (median)."""
    for _ in range(3):  # compilation (a recompile may follow when a size turns dynamic) and warm-up
        fn()
    if device == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=max(reps, 20), return_mode="median"))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def bench_spec(name: str, args: argparse.Namespace) -> list[tuple[str, str, float, float]]:
    hand_fn, full, quick = CASES[name]
    sizes = quick if args.quick else full
    op = ncd.load(SPECS / f"{name}.ncd")
    op.module.COMPILE, op.module.COMPILE_BACKEND = "always", args.backend
    hand = torch.compile(hand_fn, backend=args.backend, fullgraph=True)
    gen = torch.Generator().manual_seed(0)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    inputs = []
    for t in op.signature:  # scaled so that the matmuls stay O(1)
        shape = [sizes[a] for a in t.axes]
        scale = shape[0] ** -0.5 if t.role == "param" and len(shape) == 2 else 1.0
        value = torch.randn(shape, generator=gen) * scale
        inputs.append(value.to(args.device, dtype).requires_grad_())
    out, ref = op(*inputs), hand(*inputs)
    error = float((out.detach().float() - ref.detach().float()).norm() / ref.detach().float().norm())
    if error > (1e-4 if dtype == torch.float32 else 1e-2):
        sys.exit(f"{name}: the generic op and the hand-written function disagree (relative error {error:.1e})")
    grad_out = torch.randn_like(out)
    rows = []
    for mode in ("fwd", "fwd+bwd"):
        def run(fn, mode=mode):
            if mode == "fwd":
                with torch.no_grad():
                    return fn(*inputs)
            return torch.autograd.grad(fn(*inputs), inputs, grad_out)

        ours = timed(lambda: run(op), args.device, args.reps)
        theirs = timed(lambda: run(hand), args.device, args.reps)
        rows.append((name, mode, ours, theirs))
    shape = " ".join(f"{k}={v}" for k, v in sizes.items())
    print(f"{name} ({shape}): generic vs hand agree to {error:.1e}", flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--backend", help="torch.compile backend (default: inductor on CUDA, aot_eager on CPU)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
    parser.add_argument("--reps", type=int, default=None, help="timed calls per row (default 100; 3 with --quick)")
    parser.add_argument("--specs", default=",".join(CASES), help=f"comma-separated, from {', '.join(CASES)}")
    parser.add_argument("--json", help="write the ratios to this file (bench/results.py's format)")
    args = parser.parse_args()
    args.backend = args.backend or ("inductor" if args.device == "cuda" else "aot_eager")
    args.reps = args.reps or (3 if args.quick else 100)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"device {device_name}, torch {torch.__version__}, backend {args.backend}, {args.dtype}", flush=True)
    rows = [row for name in args.specs.split(",") for row in bench_spec(name.strip(), args)]
    print(f"\n{'spec':<16} {'pass':<8} {'generic ms':>11} {'hand ms':>9} {'generic/hand':>13}")
    for name, mode, ours, theirs in rows:
        print(f"{name:<16} {mode:<8} {ours:11.3f} {theirs:9.3f} {ours / theirs:13.2f}")
    if args.json:
        from results import generic_rows, new_run, write_results  # bench/results.py, beside this script

        sizes = {name: CASES[name][2 if args.quick else 1] for name, *_ in rows}
        write_results(args.json, new_run("generic", device_name, generic_rows(rows, sizes),
                                         source=f"bench/generic.py {' '.join(sys.argv[1:])}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
