"""What `ncd check` runs for the generic family: normal, large and zero draws through the torch.compile'd function."""

from __future__ import annotations

import torch

from ncd.ir import FLOAT_DTYPES
from ncd.ops import Op
from ncd.reference import evaluate
from ncd.validate import Case
from ncd.validation_forms import FP32, Forms, sprinkle_zeros, zero_rows


class GenericForms(Forms):
    """The generic family's one form (a PyTorch function; autograd's backward); normal, large (x64, where an
    unstabilised exponential overflows; x8 where the true result itself leaves fp32's range) and exact-zero draws
    (scattered zeros and whole zero rows: max/min/abs kinks, all-zero norms), fp32 and bf16. Every output is checked
    (concatenated); scalar inputs without a default are drawn too (and get gradients)."""

    LARGE = 64

    def cases(self, dtypes: tuple[torch.dtype, ...]) -> list[Case]:
        out = [Case(self.default_form, "normal", FP32), Case(self.default_form, "large", FP32, True),
               Case(self.default_form, "zeros", FP32, True)]
        return out + [Case(self.default_form, "normal", d, True) for d in dtypes if d != FP32]

    def draw(self, case: Case, inputs: dict[str, torch.Tensor], generator: torch.Generator | None
             ) -> dict[str, torch.Tensor]:
        out = dict(inputs)
        if case.draw == "large":  # x64: logits of a few hundred, where an unstabilised exp overflows fp32
            out = {n: v * self.LARGE for n, v in inputs.items()}
            if not self._representable(out):  # the true result itself overflows fp32 (exp(x) alone): x8
                out = {n: v * 8 for n, v in inputs.items()}
        elif case.draw == "zeros":
            out = {n: zero_rows(sprinkle_zeros(v, generator), 0, 3) if v.dim() else v for n, v in out.items()}
        device = next(iter(inputs.values())).device if inputs else "cpu"
        for t in self.op.signature:  # scalars the op needs a value for
            if not t.axes and t.default is None and t.name not in out:
                out[t.name] = torch.randn((), generator=generator).to(device=device, dtype=case.dtype) \
                    if t.dtype in FLOAT_DTYPES else torch.randint(-3, 4, (), generator=generator).to(device)
        return out

    def _representable(self, inputs: dict[str, torch.Tensor]) -> bool:
        """Whether the float64 reference's outputs at `inputs` are finite in float32."""
        program = self.op.front.program
        if any(not t.axes and t.default is None and t.name not in inputs for t in program.inputs):
            return True  # scalars are drawn after this; the x64 draw stands
        values = evaluate(program, {n: v.detach().to("cpu", torch.float64) for n, v in inputs.items()})
        return all(bool(torch.isfinite(v.float()).all()) for v in values.values())

    def call(self, op: Op, case: Case, leaves: dict[str, torch.Tensor]) -> torch.Tensor:
        result = op(**leaves)
        return torch.cat([r.flatten() for r in result]) if isinstance(result, tuple) else result

    def reference(self, op: Op, case: Case, leaves: dict[str, torch.Tensor]) -> torch.Tensor:
        outputs = evaluate(op.front.program, leaves)
        values = [outputs[t.name] for t in op.front.program.outputs]
        return torch.cat([v.flatten() for v in values]) if len(values) > 1 else values[0]
