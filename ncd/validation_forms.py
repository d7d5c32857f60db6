"""What `ncd check` runs for each kernel family: every form the generated op can dispatch to at run time,
and input draws that reach the places where kernels go wrong.

A form is selected through the op's public arguments or its config (`Op.with_config`: a twin op compiled with
another config), never by editing code or writing module globals:
    attention  with_config(factorize="never" | "always")   streamed and factorized forms (NCD_ATTENTION_FACTORIZE)
    recurrence chunk(..., chunk_size, cu_seqlens, initial_state, output_final_state)
    rational   accumulate="atomic" | "deterministic" (the op's keyword)   the coefficient-gradient reductions
    polykan    options={"basis_eval": "lut" | "recurrence"}   (a second compiled op)
Draws: "normal" (N(0, 1), conditioned into the family's domain), "large" (x8: scores of several hundred, tails
beyond where tables saturate), "zeros" (exact zeros; for attention zero query/key rows and zero multiplicities),
"masked" (attention rows with no visible key of nonzero weight), "gates" (GKA: gates at exactly 0 and -30).
The first case runs the op itself at the family's validation sizes (GKA: one sequence per head); the rest run
at smaller batch/head/row counts with the same odd sequence lengths, some on a twin compiled at small head dims
(the same generated code), so that `ncd check` stays a few seconds longer than one case.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from . import ir
from .backend import KernelPlan
from .compiler import compile_front
from .ops import Op
from .pipeline import front_end
from .reference import evaluate
from .validate import ROW_FLOOR, TOLERANCE, Case

FP32, BF16 = torch.float32, torch.bfloat16


def variant(op: Op, sizes: dict[str, int] | None = None, options: dict[str, str] | None = None) -> Op:
    """The same spec text compiled with other fixed sizes or family options (cached beside `op`'s module, with its
    config overrides); `op` itself where nothing changes."""
    new_sizes = {**dict(op.front.sizes), **(sizes or {})}
    new_options = {**dict(op.front.options), **(options or {})}
    if new_sizes == dict(op.front.sizes) and new_options == dict(op.front.options):
        return op
    front = front_end(op.front.source.text, op.front.source.filename, new_sizes, new_options)
    return Op(compile_front(front, dict(op.compiled.bindings), cache_dir=op.path.parent,
                            config=dict(op.compiled.config)))


class Forms:
    """The default: one form (the op as called), normal and large draws, fp32 and bf16."""

    default_form = "default"

    def __init__(self, op: Op, kernel_plan: KernelPlan):
        self.op = op
        self.plan: Any = kernel_plan  # the family's own plan class (roles, options)
        self._variants: dict[str, Op] = {}

    def variant(self, sizes: dict[str, int] | None = None, options: dict[str, str] | None = None) -> Op:
        key = repr((sorted((sizes or {}).items()), sorted((options or {}).items())))
        if key not in self._variants:
            self._variants[key] = variant(self.op, sizes, options)
        return self._variants[key]

    def cases(self, dtypes: tuple[torch.dtype, ...]) -> list[Case]:
        out = [Case(self.default_form, "normal", FP32), Case(self.default_form, "large", FP32, True)]
        return out + [Case(self.default_form, "normal", d, True) for d in dtypes if d != FP32]

    def op_for(self, case: Case) -> Op:
        return self.op

    def forward_only(self, case: Case) -> bool:
        """Whether the case's form has no backward (decoding): only its output is checked."""
        return False

    def sizes(self, case: Case, sizes: dict[str, int]) -> dict[str, int]:
        return sizes

    def switches(self, op: Op, case: Case) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def condition(self, program: ir.Program, inputs: dict[str, torch.Tensor], generator: torch.Generator | None
                  ) -> dict[str, torch.Tensor]:
        """Standard draws moved into the family's domain (attention: normalisers away from zero); none here."""
        return inputs

    def tolerances(self, case: Case) -> tuple[float, float]:
        """(output, gradient) relative tolerances of `case`; a family with reduced-precision products widens them."""
        return TOLERANCE[case.dtype], TOLERANCE[case.dtype]

    def gradient_tolerance(self, case: Case, name: str, default: float) -> float:
        """The relative tolerance of input `name`'s gradient (default: the case's gradient tolerance)."""
        return default

    def row_floor(self, case: Case) -> float:
        """The row metric's floor, as a fraction of the RMS row norm (validate.ROW_FLOOR by dtype)."""
        return ROW_FLOOR[case.dtype]

    def draw(self, case: Case, inputs: dict[str, torch.Tensor], generator: torch.Generator | None
             ) -> dict[str, torch.Tensor]:
        if case.draw == "large":
            return {n: v * 8 if n not in self.plan.constant_inputs() else v for n, v in inputs.items()}
        return inputs

    def call(self, op: Op, case: Case, leaves: dict[str, torch.Tensor]) -> torch.Tensor:
        return op(*[leaves[t.name] for t in op.signature if t.axes])

    def reference(self, op: Op, case: Case, leaves: dict[str, torch.Tensor]) -> torch.Tensor:
        return evaluate(op.front.program, leaves)[op.plan.output]

    def reference_conventions(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


def zero_rows(t: torch.Tensor, dim: int, every: int) -> torch.Tensor:
    """`t` with every `every`-th slice along `dim` (from the second) set to exactly 0."""
    index = torch.arange(1, t.shape[dim], every)
    out = t.clone()
    out.index_fill_(dim, index.to(t.device), 0)
    return out


def sprinkle_zeros(t: torch.Tensor, generator: torch.Generator | None, fraction: float = 0.25) -> torch.Tensor:
    keep = torch.rand(t.shape, generator=generator) >= fraction
    return t * keep.to(t.device, t.dtype)


class DictSwitch:
    """Sets entries of a dict for the duration of a block (the reference's function table)."""

    def __init__(self, table: dict, values: dict):
        self.table, self.values = table, values
        self.saved: dict = {}

    def __enter__(self) -> None:
        self.saved = {k: self.table[k] for k in self.values}
        self.table.update(self.values)

    def __exit__(self, *exc: object) -> None:
        self.table.update(self.saved)



def forms_for(op: Op) -> Forms:
    """The validation description of the family that planned `op` (the registry's `forms` entry)."""
    from .families import family

    kernel_plan = op.plan
    forms = family(kernel_plan.family).load(family(kernel_plan.family).forms)
    assert isinstance(forms, type) and issubclass(forms, Forms)
    return forms(op, kernel_plan)


def describe(cases: list[Case]) -> Iterator[str]:
    for c in cases:
        yield f"{c.label} ({c.dtype_name}{', small' if c.small else ''})"


__all__ = ["BF16", "FP32", "DictSwitch", "Forms", "forms_for", "sprinkle_zeros", "variant", "zero_rows"]
