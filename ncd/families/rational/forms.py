"""What `ncd check` runs for group rational activations: atomic and deterministic coefficient-gradient
reductions, exact zeros, large inputs."""

from __future__ import annotations

import contextlib

import torch

from ncd import reference
from ncd.ops import Op
from ncd.reference import evaluate
from ncd.validate import Case
from ncd.validation_forms import FP32, DictSwitch, Forms, sprinkle_zeros, zero_rows


class _AbsPlus(torch.autograd.Function):
    """|u| differentiated to sign+(u), sign+(0) = +1: the rational family's documented convention."""

    @staticmethod
    def forward(ctx, u):  # type: ignore[override]
        ctx.save_for_backward(u)
        return u.abs()

    @staticmethod
    def backward(ctx, du):  # type: ignore[override]
        (u,) = ctx.saved_tensors
        return du * torch.where(u < 0, -1.0, 1.0).to(du.dtype)


class RationalForms(Forms):
    """Atomic and deterministic accumulation of the coefficient gradients; exact zeros in x and in the
    denominator coefficients (sign+(0) = +1), tails (|x| up to ~30), bf16."""

    default_form = "atomic"

    def cases(self, dtypes: tuple[torch.dtype, ...]) -> list[Case]:
        out = [Case("atomic", "normal", FP32), Case("deterministic", "normal", FP32, True),
               Case("atomic", "zeros", FP32, True), Case("atomic", "large", FP32, True)]
        return out + [Case("atomic", "normal", d, True) for d in dtypes if d != FP32]

    def call(self, op: Op, case: Case, leaves: dict[str, torch.Tensor]) -> torch.Tensor:
        """The op with the case's accumulation as its keyword argument (`accumulate`, or the name the spec left)."""
        tensors = [leaves[t.name] for t in op.signature if t.axes]
        return op(*tensors, **{op.module._OP.keyword: case.form})

    def sizes(self, case: Case, sizes: dict[str, int]) -> dict[str, int]:
        return {**sizes, self.plan.roles.row: 37} if case.small else sizes

    def draw(self, case: Case, inputs: dict[str, torch.Tensor], generator: torch.Generator | None
             ) -> dict[str, torch.Tensor]:
        x = self.plan.roles.x
        out = dict(inputs)
        if case.draw == "large":
            out[x] = inputs[x] * 8
        elif case.draw == "zeros":
            out[x] = sprinkle_zeros(inputs[x], generator)
            for p in self.op.front.program.params:  # KAT's identity init: the denominator starts at 0
                if len(p.axes) > 1:
                    out[p.name] = zero_rows(inputs[p.name], 0, 2)
            return out  # exact kinks on purpose: they test sign+(0) = +1
        return self._off_the_kinks(out, x, generator)

    def _off_the_kinks(self, inputs: dict[str, torch.Tensor], x: str, generator: torch.Generator | None
                       ) -> dict[str, torch.Tensor]:
        """x moved away from where an |u| of the spec sits within fp32 rounding of its kink u = 0: there the side
        an fp32 evaluation lands on depends on its order of operations, d|u|/du flips between -1 and +1, and the
        coefficient gradients (sums over every element) take the flip at full weight -- a draw that tests rounding
        luck, not the kernel (at |x| ~ 28, |u| ~ 1e6 has an fp32 rounding of ~0.06). The margin is 100 times
        the largest difference between u evaluated in fp32 and in float64."""
        out = dict(inputs)
        for _ in range(10):
            found: dict[torch.dtype, list[torch.Tensor]] = {torch.float64: [], torch.float32: []}
            for dtype, store in found.items():
                def record(u: torch.Tensor, store: list[torch.Tensor] = store) -> torch.Tensor:
                    store.append(u.detach().double())
                    return u.abs()

                leaves = {n: v.detach().to("cpu", dtype) for n, v in out.items()}
                with DictSwitch(reference._UNARY, {"abs": record}):
                    evaluate(self.op.front.program, leaves, dtype)
            near = torch.zeros(out[x].shape, dtype=torch.bool)
            for u64, u32 in zip(found[torch.float64], found[torch.float32], strict=True):
                if u64.shape == near.shape:
                    near |= u64.abs() <= 100 * (u64 - u32).abs().max()
            if not near.any():
                break
            nudge = 1 + 0.1 * torch.rand(near.shape, generator=generator)
            out[x] = torch.where(near.to(out[x].device), out[x] * nudge.to(out[x].device, out[x].dtype), out[x])
        return out

    def reference_conventions(self) -> contextlib.AbstractContextManager:
        return DictSwitch(reference._UNARY, {"abs": _AbsPlus.apply})
