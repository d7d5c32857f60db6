"""Numerical validation of a compiled spec against the float64 reference evaluation of its own IR.

Fresh random inputs at small odd sizes (not multiples of any block), outputs poisoned with NaN by the
generated launchers (NCD_POISON), forward and every input gradient compared by relative error
||out - ref|| / ||ref||. Used by `ncd check` and by the test suite, so no spec needs Python of its own."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .attention import AttentionRoles
from .backend import plan
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


def attention_sizes(roles: AttentionRoles, op: Op) -> dict[str, int]:
    """Odd sizes: 37 queries, 29 keys; 2 kv heads with 2 query heads each where heads are grouped."""
    program = op.front.program
    sizes = {roles.q_axes[0]: 2, roles.q_axes[2]: 37, roles.k_axes[2]: 29}
    head, kv_head = roles.q_axes[1], roles.k_axes[1]
    if head != kv_head:
        sizes[kv_head] = 2
        for f in program.axis(head).factors:
            sizes.setdefault(f, 2)
        sizes[head] = 4
    else:
        sizes[head] = 3
    for axis in program.axes:
        if axis.fixed is not None:
            sizes[axis.name] = axis.fixed
        elif axis.name not in sizes:
            sizes[axis.name] = 16  # e.g. a head dim bound at call time
    return sizes


def random_inputs(op: Op, sizes: dict[str, int], dtype: torch.dtype, device: str,
                  generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    program = op.front.program
    roles = plan(op.front).roles
    inputs = {}
    for t in program.inputs:
        if not t.axes:
            continue
        shape = [sizes[a] for a in t.axes]
        if t.name == roles.weight:  # multiplicities: positive
            value = torch.rand(shape, generator=generator, dtype=torch.float32) * 1.5 + 0.5
        else:
            value = torch.randn(shape, generator=generator, dtype=torch.float32)
        inputs[t.name] = value.to(device=device, dtype=dtype if t.name != roles.weight else torch.float32)
    return inputs


def validate(op: Op, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int | None = None) -> list[Row]:
    attention_plan = plan(op.front)
    sizes = attention_sizes(attention_plan.roles, op)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    inputs = random_inputs(op, sizes, dtype, device, generator)
    differentiable = [n for n in inputs if n != attention_plan.roles.weight]
    leaves = {n: v.detach().requires_grad_(n in differentiable) for n, v in inputs.items()}
    args = [leaves[t.name] for t in op.front.program.inputs if t.axes]
    out = op(*args)
    grad_out = torch.randn(out.shape, dtype=torch.float32, generator=generator).to(device=device, dtype=dtype)
    grads = torch.autograd.grad(out, [leaves[n] for n in differentiable], grad_out)

    ref_leaves = {n: v.detach().to("cpu", torch.float64).requires_grad_(n in differentiable)
                  for n, v in inputs.items()}
    ref = evaluate(op.front.program, ref_leaves)[attention_plan.roles.output]
    ref_grads = torch.autograd.grad(ref, [ref_leaves[n] for n in differentiable], grad_out.cpu().double())

    tol = TOLERANCE[dtype]
    name = str(dtype).removeprefix("torch.")
    rows = [Row(attention_plan.roles.output, name, _rel(out, ref), tol)]
    rows += [Row(f"d{n}", name, _rel(g, r), tol) for n, g, r in zip(differentiable, grads, ref_grads, strict=True)]
    return rows


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
