"""Numerical validation of a compiled spec against the float64 reference evaluation of its own IR.

Fresh random inputs at small odd sizes (not multiples of any block), outputs poisoned with NaN by the
launchers (`ncd.settings.poisoned`), forward and every input gradient compared two ways: over the whole
tensor, ||out - ref|| / ||ref||, and row by row (each row over the last axis, relative to the larger of its own
norm and a floor tied to the tensor's RMS row norm), so that an error confined to a few rows or tokens is not
averaged away. `validate` runs one case (the op's default form, standard normal inputs); `check_op` runs every
case of `ncd.validation_forms`: each form the op can dispatch to at run time, fp32 and bf16, and draws at
several scales (large logits, exact zeros, tails, zero multiplicities, masked rows, three or more chunks).
Used by `ncd check` and by the test suite, so no spec needs Python of its own."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from . import ir
from .backend import KernelPlan
from .ops import Op
from .reference import evaluate
from .settings import poisoned

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 5e-3}
# Row metric: a row's error is judged against max(its norm, ROW_FLOOR * the RMS row norm) and may reach
# ROW_FACTOR times the whole-tensor tolerance (the worst of many rows sits above the average). Rounding noise
# is absolute, at the tensor's scale: in bf16 it is 2^16 times fp32's, so a small row (a causal first row's dQ,
# mathematically ~0; GKA's first tokens) is judged against the RMS row itself (measured: causal spherical bf16
# dQ rows reach 2x the tolerance at floor 0.25, 0.5x at 1); fp32 keeps a low floor that finds per-token errors.
ROW_FLOOR = {torch.float32: 0.25, torch.bfloat16: 1.0, torch.float16: 1.0}
ROW_FACTOR = 4.0


@dataclass(frozen=True)
class Row:
    """One quantity (the output or a gradient): its whole-tensor error and its worst row's (see row_error)."""

    quantity: str
    dtype: str
    error: float
    tolerance: float
    row_error: float = 0.0
    row_tolerance: float = math.inf
    case: str = ""  # "form / draw" for rows of `check_op`

    @property
    def ok(self) -> bool:
        return (math.isfinite(self.error) and self.error <= self.tolerance
                and math.isfinite(self.row_error) and self.row_error <= self.row_tolerance)

    @property
    def margin(self) -> float:
        """The larger of error / tolerance over both metrics (inf where one is not finite)."""
        if not (math.isfinite(self.error) and math.isfinite(self.row_error)):
            return math.inf
        return max(self.error / self.tolerance, self.row_error / self.row_tolerance)


@dataclass
class Drawn:
    """What a case ran on, kept for notes that re-evaluate the reference (chebyshev_solve's)."""

    inputs: dict[str, torch.Tensor]
    differentiable: list[str]
    grad_out: torch.Tensor
    ref_grads: tuple[torch.Tensor, ...]


class Report(list[Row]):
    """The rows, and notes that explain them without being checks (`ncd check` prints both)."""

    def __init__(self, rows: list[Row], notes: list[str] | None = None, drawn: Drawn | None = None):
        super().__init__(rows)
        self.notes = notes or []
        self.drawn = drawn

    def __iadd__(self, other: list[Row]) -> Report:  # type: ignore[override,misc]
        self.extend(other)
        if isinstance(other, Report):
            self.notes += other.notes
        return self


INTEGER_DTYPES = {"i32": torch.int32, "i64": torch.int64}


def random_inputs(op: Op, kernel_plan: KernelPlan, sizes: dict[str, int], dtype: torch.dtype, device: str,
                  generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """Standard normal tensors; inputs the plan treats as constants (multiplicities) in [0.5, 2), fp32."""
    inputs = {}
    for t in op.signature:
        if not t.axes:
            continue
        shape = [sizes[a] for a in t.axes]
        if t.dtype in INTEGER_DTYPES:  # lengths, ids: small, at least 2 (one key is no test); forms refine them
            inputs[t.name] = torch.randint(2, 6, shape, generator=generator).to(device, INTEGER_DTYPES[t.dtype])
        elif t.dtype == "bool":
            inputs[t.name] = (torch.rand(shape, generator=generator) < 0.7).to(device)
        elif t.name in kernel_plan.constant_inputs():
            value = torch.rand(shape, generator=generator, dtype=torch.float32) * 1.5 + 0.5
            inputs[t.name] = value.to(device)
        else:
            value = torch.randn(shape, generator=generator, dtype=torch.float32)
            inputs[t.name] = value.to(device=device, dtype=dtype)
    return inputs


@dataclass(frozen=True)
class Case:
    """One validation run: a form the op dispatches to, a draw of inputs, a dtype; `small` shrinks the free
    sizes (batch, heads, rows) of the family's validation sizes, keeping the odd sequence lengths."""

    form: str
    draw: str
    dtype: torch.dtype
    small: bool = False

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def label(self) -> str:
        return f"{self.form} / {self.draw}"


def validate(op: Op, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int | None = None) -> Report:
    """The op's default form at standard normal inputs (whole-tensor and per-row rows)."""
    from .validation_forms import forms_for

    forms = forms_for(op)
    report = run_case(op, forms, Case(forms.default_form, "normal", dtype), device, seed)
    report.notes += _solve_notes(op, report, device, seed)
    return report


def check_op(op: Op, dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16), device: str = "cpu",
             seed: int = 0, on_case: Callable[[Case, Report], None] | None = None,
             only: Callable[[Case], bool] | None = None) -> list[tuple[Case, Report]]:
    """Every case `ncd check` runs for this op (`only` selects some); `on_case` sees each report as it comes."""
    from .validation_forms import forms_for

    forms = forms_for(op)
    results = []
    for index, case in enumerate(forms.cases(dtypes)):
        if only is not None and not only(case):
            continue
        try:
            report = run_case(op, forms, case, device, seed + index)
        except Exception as err:  # a form that raises is a failed case, reported with the others
            report = Report([Row(f"({type(err).__name__})", case.dtype_name, math.nan, TOLERANCE[case.dtype],
                                 case=case.label)],
                            [f"{case.label} ({case.dtype_name}) raised {type(err).__name__}: {err}"])
        if index == 0 and report.notes == []:
            report.notes += _solve_notes(op, report, device, seed)
        results.append((case, report))
        if on_case is not None:
            on_case(case, report)
    return results


def case_inputs(forms, case: Case, device: str = "cpu", generator: torch.Generator | None = None,
                drawn: bool = True) -> tuple[Op, dict[str, torch.Tensor]]:
    """The op `case` runs and its inputs: standard draws at the family's validation sizes, conditioned into its
    domain, then (`drawn`) moved to the case's draw."""
    target = forms.op_for(case)
    sizes = forms.sizes(case, target.plan.validation_sizes(target.front.program))
    inputs = random_inputs(target, target.plan, sizes, case.dtype, device, generator)
    inputs = forms.condition(target.front.program, inputs, generator)
    return target, forms.draw(case, inputs, generator) if drawn else inputs


def run_case(op: Op, forms, case: Case, device: str = "cpu", seed: int | None = None) -> Report:
    """Draw inputs for `case`, run the op in the case's form, compare output and gradients with float64."""
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    target, inputs = case_inputs(forms, case, device, generator)
    kernel_plan = target.plan
    differentiable = [] if forms.forward_only(case) else [n for n in inputs if n not in kernel_plan.constant_inputs()]
    leaves = {n: v.detach().requires_grad_(n in differentiable) for n, v in inputs.items()}
    with forms.switches(target, case), poisoned():  # an element a kernel forgets to store shows up as NaN
        out = forms.call(target, case, leaves)
        grad_out = torch.randn(out.shape, dtype=torch.float32, generator=generator).to(device=device,
                                                                                      dtype=out.dtype)
        grads = torch.autograd.grad(out, [leaves[n] for n in differentiable], grad_out) if differentiable else ()
    ref_leaves = {n: v.detach().to("cpu", torch.float64).requires_grad_(n in differentiable)
                  for n, v in inputs.items()}
    with forms.reference_conventions():
        ref = forms.reference(target, case, ref_leaves)
        ref_grads = torch.autograd.grad(ref, [ref_leaves[n] for n in differentiable], grad_out.cpu().double(),
                                        allow_unused=True) if differentiable else ()
    ref_grads = tuple(torch.zeros_like(ref_leaves[n]) if g is None else g
                      for n, g in zip(differentiable, ref_grads, strict=True))
    scales = _cancellation_scales((ref, *ref_grads))

    name = case.dtype_name
    tol, grad_tol = forms.tolerances(case)  # a family may state looser ones (reduced-precision products)
    quantities = [(kernel_plan.output, out, ref, tol)]
    quantities += [(f"d{n}", g, r, forms.gradient_tolerance(case, n, grad_tol))
                   for n, g, r in zip(differentiable, grads, ref_grads, strict=True)]
    floor = forms.row_floor(case)
    rows, notes = [], []
    for (q, v, r, t), scale in zip(quantities, scales, strict=True):
        rows.append(Row(q, name, _rel(v, r, scale), t, row_error(v, r, floor, scale), t * ROW_FACTOR, case.label))
        if scale is not None:
            notes.append(f"{case.label}: {q} cancels to zero (float64 norm {float(r.detach().norm()):.1e}): judged "
                         f"against the case's largest quantity ({scale:.1e})")
    return Report(rows, notes, drawn=Drawn(inputs, differentiable, grad_out, ref_grads))


CANCELS = 1e-9
"""A quantity whose float64 reference is below CANCELS times the largest of its case (the output's or a gradient's
norm) is zero in exact arithmetic (a per-row shift of softmax scores; the scale of a spherical normaliser): the
float64 value is only rounding, and the kernel's, rounding of terms that cancel. It is judged against that
largest norm, so noise passes and a value of the size of the case's quantities fails."""


def _cancellation_scales(refs: tuple[torch.Tensor, ...]) -> list[float | None]:
    """Per quantity (the output, then each gradient), the largest norm of the case where it cancels, else None."""
    norms = [float(r.detach().norm()) if r.numel() and torch.isfinite(r).all() else math.nan for r in refs]
    largest = max((n for n in norms if math.isfinite(n)), default=0.0)
    return [largest if math.isfinite(n) and largest > 0 and n < CANCELS * largest else None for n in norms]


def _solve_notes(op: Op, report: Report, device: str, seed: int | None) -> list[str]:
    """What the implicit differentiation of chebyshev_solve means at this spec's iteration count: how far the
    gradients checked above are from autograd through the iterations (the same once the iteration converges)."""
    solves = [n for d in op.front.program.definitions for n in ir.walk(d.value) if isinstance(n, ir.ChebyshevSolve)]
    if not solves or report.drawn is None:
        return []
    inputs, differentiable, grad_out = report.drawn.inputs, report.drawn.differentiable, report.drawn.grad_out
    kernel_plan = op.plan

    def gradients(unrolled: bool) -> tuple[torch.Tensor, ...]:
        leaves = {n: v.detach().to("cpu", torch.float64).requires_grad_(n in differentiable) for n, v in inputs.items()}
        value = evaluate(op.front.program, leaves, unrolled_solves=unrolled)[kernel_plan.output]
        return torch.autograd.grad(value, [leaves[n] for n in differentiable], grad_out.cpu().double())

    implicit, unrolled = report.drawn.ref_grads, gradients(True)
    gaps = {f"d{n}": _rel(i, u) for n, i, u in zip(differentiable, implicit, unrolled, strict=True)}
    worst = max(gaps, key=lambda k: gaps[k])
    iterations = ", ".join(str(s.iterations) for s in solves)
    dtype_name = report[0].dtype if report else "float32"
    return [f"{dtype_name}: chebyshev_solve ({iterations} iterations) is differentiated as the exact solve, as the "
            f"generated backward does; autograd through the iterations differs from that by up to "
            f"{gaps[worst]:.1e} ({worst}), which more iterations shrink"]


def _rel(value: torch.Tensor, ref: torch.Tensor, cancelling: float | None = None) -> float:
    """||value - ref|| / ||ref||; cancelling: for a ref that cancels to zero (`CANCELS`), the norm judged against
    instead."""
    value, ref = value.detach().to("cpu", torch.float64), ref.detach()
    if torch.isnan(value).any() or torch.isnan(ref).any():
        return float("nan")
    scale = ref.norm() if cancelling is None else torch.tensor(cancelling, dtype=torch.float64)
    return float((value - ref).norm() / scale.clamp_min(1e-300))


def row_error(value: torch.Tensor, ref: torch.Tensor, floor: float = 0.25, cancelling: float | None = None) -> float:
    """The worst row (over the last axis) of ||out_row - ref_row|| / max(||ref_row||, floor * RMS row norm): a
    few wrong rows or tokens fail even when the whole-tensor norm averages them away, and tiny rows are judged
    against the tensor's scale instead of blowing up. cancelling: as `_rel`'s (the RMS row norm taken from it)."""
    value, ref = value.detach().to("cpu", torch.float64), ref.detach().to(torch.float64)
    if torch.isnan(value).any() or torch.isnan(ref).any():
        return float("nan")
    width = ref.shape[-1] if ref.dim() else 1
    diff = (value - ref).reshape(-1, width).norm(dim=1)
    norms = ref.reshape(-1, width).norm(dim=1)
    rms = norms.square().mean().sqrt() if cancelling is None else cancelling / max(len(norms), 1) ** 0.5
    least = floor * rms
    return float((diff / torch.maximum(norms, torch.as_tensor(least, dtype=torch.float64)).clamp_min(1e-300)).max())


def format_rows(rows: list[Row]) -> list[str]:
    lines = [f"  {'quantity':<10} {'dtype':<9} {'rel. error':>11} {'tolerance':>10} {'worst row':>10} "
             f"{'tolerance':>10}  result"]
    for r in rows:
        lines.append(f"  {r.quantity:<10} {r.dtype:<9} {r.error:11.2e} {r.tolerance:10.0e} {r.row_error:10.2e} "
                     f"{r.row_tolerance:10.0e}  {'ok' if r.ok else 'FAIL'}")
    return lines


def iter_failures(results: list[tuple[Case, Report]]) -> Iterator[tuple[Case, Row]]:
    for case, report in results:
        for row in report:
            if not row.ok:
                yield case, row
