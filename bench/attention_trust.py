"""GPU check of the attention paths issue 30 added (CUDA; what tests/test_attention_trust.py checks on the interpreter):

- the stabiliser pre-map (softcapping exp(100 tanh(x / 100)), softmin exp(-x)) at scores up to ~1e3,
- masked rows (causal, zero weights on the first keys): output 0 and zero gradients, streamed and factorized,
- the per-key weight's gradient kernel and a tensor scale's gradient,
- plain softmax at large scores (the exp2 kernels, unchanged).

fp32 and bf16, odd sizes (N 1000, D 64), outputs poisoned with NaN; forward and every gradient against the float64
reference of the spec's own IR (max-shifted float64 softmax where exp overflows float64). Exits non-zero on failure.

    PYTHONUNBUFFERED=1 python3 bench/attention_trust.py [--sections large,masked,weight,scale]

Each new module autotunes its kernels on first use: on an H100 the two `large` specs took about 7 minutes, so run the
sections in separate commands where a command's time is bounded.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

import ncd
from ncd.reference import evaluate
from ncd.settings import poisoned

SPEC = """spec {name}
axis batch, head, query, key
axis dim
in  Q[batch head query dim] : f32
in  K[batch head key dim]   : f32
in  V[batch head key dim]   : f32
{extra}
S[batch head query key] = {score}
A[batch head query key] = normalize(S, over key, a1(x) = {a1}, a2(x) = {a2}, b(z) = {b}{options})
out O[batch head query dim] = A . V over key
"""
TOL = {torch.float32: 2e-3, torch.bfloat16: 3e-2}


def load(directory: Path, name: str, a1: str, a2: str | None = None, b: str = "z", weighted: bool = False,
         causal: bool = False, scale_input: bool = False):
    extra = ("in  M[batch key] : f32\n" if weighted else "") + ("in  scale : f32\n" if scale_input else "")
    options = (", mask = key <= query" if causal else "") + (", weight = M" if weighted else "")
    score = "scale * (Q . K over dim)" if scale_input else "(Q . K over dim) / sqrt(size(dim))"
    path = directory / f"{name}.ncd"
    path.write_text(SPEC.format(name=name, a1=a1, a2=a2 or a1, b=b, extra=extra, score=score, options=options))
    return ncd.load(path, cache_dir=directory / "cache")


def rel(value, ref) -> float:
    value, ref = value.detach().cpu().double(), ref.detach().double()
    if not torch.isfinite(value).all():
        return float("inf")
    return float((value - ref).norm() / ref.norm().clamp_min(1e-300))


def run(op, inputs, differentiable, dtype, reference=None):
    leaves = {n: (t.to(dtype) if n in "QKV" else t).detach().requires_grad_(n in differentiable)
              for n, t in inputs.items()}
    out = op(*leaves.values())
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, [leaves[n] for n in differentiable], grad_out)
    # the float64 reference runs on the CPU (ncd/reference.py makes its constants there)
    ref_leaves = {n: leaves[n].detach().cpu().double().requires_grad_(n in differentiable) for n in inputs}
    ref = (reference or (lambda t: evaluate(op.front.program, t)["O"]))(ref_leaves)
    ref_grads = torch.autograd.grad(ref, [ref_leaves[n] for n in differentiable], grad_out.cpu().double())
    return out, dict(zip(differentiable, grads, strict=True)), ref, dict(zip(differentiable, ref_grads, strict=True))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sections", default="large,masked,weight,scale")
    sections = set(parser.parse_args().sections.split(","))
    torch.manual_seed(0)
    directory = Path(tempfile.mkdtemp(prefix="ncd-trust-"))
    b, h, n, d = 1, 3, 1000, 64
    ok = True

    def report(label, out, grads, ref, ref_grads, dtype, extra_ok=True):
        nonlocal ok
        errors = {"O": rel(out, ref), **{f"d{k}": rel(g, ref_grads[k]) for k, g in grads.items()}}
        good = extra_ok and all(e < TOL[dtype] for e in errors.values())
        ok &= good
        print(f"{label:42s} {str(dtype)[6:]:9s} " + " ".join(f"{k}={e:.1e}" for k, e in errors.items())
              + ("  OK" if good else "  FAIL"), flush=True)

    big = {x: torch.randn(b, h, n, d, device="cuda") * (12.0 if x != "V" else 1.0) for x in "QKV"}
    for name, a1, sign in [("softcap", "exp(100 * tanh(x / 100))", None), ("softmin", "exp(-x)", -1.0),
                           ("softmax", "exp(x)", 1.0)] if "large" in sections else []:
        op = load(directory, f"{name}_trust", a1)
        for dtype in (torch.float32, torch.bfloat16):
            reference = None
            if sign is not None:  # float64 exp overflows past 709: the max-shifted softmax
                def reference(t, sign=sign):
                    return torch.softmax(sign * (t["Q"] @ t["K"].transpose(-1, -2)) * d**-0.5, -1) @ t["V"]
            report(f"{name}, scores up to ~1e3", *run(op, big, "QKV", dtype, reference), dtype)

    weight = torch.rand(b, n, device="cuda") + 0.5
    weight[:, :37] = 0.0
    masked = {**{x: torch.randn(b, h, n, d, device="cuda") for x in "QKV"}, "M": weight}
    for name, a1, a2, b_ in [("softmax", "exp(x)", None, "z"), ("spherical", "x", "x^2", "sqrt(z)"),
                             ("softcap", "exp(30 * tanh(x / 30))", None, "z")] if "masked" in sections else []:
        op = load(directory, f"masked_{name}", a1, a2, b_, weighted=True, causal=True)
        forms = ["never", "always"] if op.config.factorized else [None]
        for form in forms:
            if form:
                op = op.with_config(factorize=form)
            for dtype in (torch.float32, torch.bfloat16):
                out, grads, ref, ref_grads = run(op, masked, "QKV", dtype)
                zero = bool((out[:, :, :37] == 0).all() and (grads["Q"][:, :, :37] == 0).all()
                            and (grads["K"][:, :, :37] == 0).all() and (grads["V"][:, :, :37] == 0).all())
                report(f"masked rows, {name} {form or ''} zero={zero}", out, grads, ref, ref_grads, dtype, zero)
    weighted = {**{x: torch.randn(b, h, n, d, device="cuda") for x in "QKV"}, "M": torch.rand(b, n, device="cuda") + .5}
    for name, a1, a2, b_ in [("softmax", "exp(x)", None, "z"), ("spherical", "x", "x^2", "sqrt(z)")] \
            if "weight" in sections else []:
        op = load(directory, f"dw_{name}", a1, a2, b_, weighted=True, causal=True)
        for form in (["never", "always"] if op.config.factorized else [None]):
            if form:
                op = op.with_config(factorize=form)
            report(f"weight gradient, {name} {form or ''}", *run(op, weighted, "QKVM", torch.float32), torch.float32)
    if "scale" in sections:
        op = load(directory, "scale_grad", "exp(x)", scale_input=True)
        scaled = {**{x: torch.randn(b, h, n, d, device="cuda") for x in "QKV"},
                  "scale": torch.tensor(0.2, device="cuda")}
        report("tensor scale gradient", *run(op, scaled, ("Q", "K", "V", "scale"), torch.float32), torch.float32)
    print("trust check", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    with poisoned():  # every output buffer starts as NaN: anything the kernels leave unwritten shows
        sys.exit(main())
