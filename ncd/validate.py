"""Numerical validation of a compiled spec against the float64 reference evaluation of its own IR.

Fresh random inputs at small odd sizes (not multiples of any block), outputs poisoned with NaN by the
generated launchers (NCD_POISON), forward and every input gradient compared by relative error
||out - ref|| / ||ref||. Used by `ncd check` and by the test suite, so no spec needs Python of its own."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import ir
from .backend import KernelPlan, plan
from .ops import Op
from .reference import evaluate

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 5e-3}


@dataclass(frozen=True)
class Row:
    quantity: str
    dtype: str
    error: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return math.isfinite(self.error) and self.error <= self.tolerance


class Report(list[Row]):
    """The rows, and notes that explain them without being checks (`ncd check` prints both)."""

    def __init__(self, rows: list[Row], notes: list[str] | None = None):
        super().__init__(rows)
        self.notes = notes or []

    def __iadd__(self, other: list[Row]) -> Report:  # type: ignore[override,misc]
        self.extend(other)
        self.notes += getattr(other, "notes", [])
        return self


def random_inputs(op: Op, kernel_plan: KernelPlan, sizes: dict[str, int], dtype: torch.dtype, device: str,
                  generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """Standard normal tensors; inputs the plan treats as constants (multiplicities) in [0.5, 2), fp32."""
    inputs = {}
    for t in op.signature:
        if not t.axes:
            continue
        shape = [sizes[a] for a in t.axes]
        if t.name in kernel_plan.constant_inputs():
            value = torch.rand(shape, generator=generator, dtype=torch.float32) * 1.5 + 0.5
            inputs[t.name] = value.to(device)
        else:
            value = torch.randn(shape, generator=generator, dtype=torch.float32)
            inputs[t.name] = value.to(device=device, dtype=dtype)
    return inputs


def validate(op: Op, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int | None = None) -> Report:
    kernel_plan = plan(op.front)
    sizes = kernel_plan.validation_sizes(op.front.program)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    inputs = random_inputs(op, kernel_plan, sizes, dtype, device, generator)
    condition = getattr(kernel_plan, "condition_inputs", None)  # families whose inputs have a domain
    if condition is not None:
        inputs = condition(op.front.program, inputs, generator)
    differentiable = [n for n in inputs if n not in kernel_plan.constant_inputs()]
    leaves = {n: v.detach().requires_grad_(n in differentiable) for n, v in inputs.items()}
    out = op(*[leaves[t.name] for t in op.signature if t.axes])
    grad_out = torch.randn(out.shape, dtype=torch.float32, generator=generator).to(device=device, dtype=dtype)
    grads = torch.autograd.grad(out, [leaves[n] for n in differentiable], grad_out)

    def reference(unrolled_solves=False):
        leaves = {n: v.detach().to("cpu", torch.float64).requires_grad_(n in differentiable) for n, v in inputs.items()}
        value = evaluate(op.front.program, leaves, unrolled_solves=unrolled_solves)[kernel_plan.output]
        return value, torch.autograd.grad(value, [leaves[n] for n in differentiable], grad_out.cpu().double())

    ref, ref_grads = reference()

    name = str(dtype).removeprefix("torch.")
    # a family may state looser tolerances (reduced-precision products)
    tol = max(TOLERANCE[dtype], getattr(kernel_plan, "output_tolerance", {}).get(name, 0.0))
    grad_tol = max(tol, getattr(kernel_plan, "gradient_tolerance", {}).get(name, tol))
    rows = [Row(kernel_plan.output, name, _rel(out, ref), tol)]
    rows += [Row(f"d{n}", name, _rel(g, r), grad_tol)
             for n, g, r in zip(differentiable, grads, ref_grads, strict=True)]
    return Report(rows, _solve_notes(op, differentiable, ref_grads, reference, name))


def _solve_notes(op, differentiable, implicit, reference, dtype_name) -> list[str]:
    """What the implicit differentiation of chebyshev_solve means at this spec's iteration count: how far the
    gradients checked above are from autograd through the iterations (the same once the iteration converges)."""
    solves = [n for d in op.front.program.definitions for n in ir.walk(d.value) if isinstance(n, ir.ChebyshevSolve)]
    if not solves:
        return []
    _, unrolled = reference(unrolled_solves=True)
    gaps = {f"d{n}": _rel(i, u) for n, i, u in zip(differentiable, implicit, unrolled, strict=True)}
    worst = max(gaps, key=lambda k: gaps[k])
    iterations = ", ".join(str(s.iterations) for s in solves)
    return [f"{dtype_name}: chebyshev_solve ({iterations} iterations) is differentiated as the exact solve, as the "
            f"generated backward does; autograd through the iterations differs from that by up to "
            f"{gaps[worst]:.1e} ({worst}), which more iterations shrink"]


def _rel(value: torch.Tensor, ref: torch.Tensor) -> float:
    value, ref = value.detach().to("cpu", torch.float64), ref.detach()
    if torch.isnan(value).any():
        return float("nan")
    return float((value - ref).norm() / ref.norm().clamp_min(1e-300))


def format_rows(rows: list[Row]) -> list[str]:
    lines = [f"  {'quantity':<10} {'dtype':<9} {'rel. error':>11} {'tolerance':>10}  result"]
    for r in rows:
        lines.append(f"  {r.quantity:<10} {r.dtype:<9} {r.error:11.2e} {r.tolerance:10.0e}  {'ok' if r.ok else 'FAIL'}")
    return lines
