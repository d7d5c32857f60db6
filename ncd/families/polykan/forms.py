"""What `ncd check` runs for polynomial KAN layers: the LUT and recurrence basis evaluations, exact zeros,
inputs beyond the table range."""

from __future__ import annotations

import torch

from ncd.ops import Op
from ncd.validate import Case
from ncd.validation_forms import FP32, Forms, sprinkle_zeros


class PolyKANForms(Forms):
    """Lookup-table and recurrence basis evaluation (two compiled ops); exact zeros; tails beyond where the
    table's argument saturates (|x| up to ~30); bf16."""

    def _modes(self) -> list[str]:
        return ["lut", "recurrence"] if self.plan.basis_eval == "lut" else [self.plan.basis_eval]

    @property
    def default_form(self) -> str:  # type: ignore[override]
        return self._modes()[0]

    def cases(self, dtypes: tuple[torch.dtype, ...]) -> list[Case]:
        modes = self._modes()
        out = [Case(modes[0], "normal", FP32)]
        for mode in modes:
            if mode != modes[0]:
                out.append(Case(mode, "normal", FP32, True))
            out += [Case(mode, "zeros", FP32, True), Case(mode, "large", FP32, True)]
        return out + [Case(modes[0], "normal", d, True) for d in dtypes if d != FP32]

    def op_for(self, case: Case) -> Op:
        if case.form == self.plan.basis_eval:
            return self.op
        return self.variant(options={"basis_eval": case.form})

    def sizes(self, case: Case, sizes: dict[str, int]) -> dict[str, int]:
        return {**sizes, self.plan.roles.batch: 9} if case.small else sizes

    def draw(self, case: Case, inputs: dict[str, torch.Tensor], generator: torch.Generator | None
             ) -> dict[str, torch.Tensor]:
        x = self.plan.roles.x
        if case.draw == "large":
            return {**inputs, x: inputs[x] * 8}
        if case.draw == "zeros":
            return {**inputs, x: sprinkle_zeros(inputs[x], generator)}
        return inputs
