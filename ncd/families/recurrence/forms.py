"""What `ncd check` runs for the gated recurrence: chunk sizes, packed sequences (cu_seqlens), initial state,
decoding from a prefill's state, gates at 0 and -30, fast-forgetting gates at 16 bits, and the delta rule's writing
strengths at 0 and 1."""

from __future__ import annotations

import torch

from ncd import ir
from ncd.families.recurrence.delta import DeltaRulePlan
from ncd.families.recurrence.linear import group_sizes
from ncd.families.recurrence.plan import RecurrencePlan
from ncd.ops import Op
from ncd.reference import evaluate
from ncd.validate import Case
from ncd.validation_forms import FP32, Forms


class RecurrenceForms(Forms):
    """Gated KalmaNet, gated linear attention and the delta rule: the default chunk size at the spec's sizes; chunk
    sizes 16 and 32 (three and two chunks at 37 tokens), packed sequences (`cu_seqlens`), a chained call through
    `initial_state`/`output_final_state`, and decoding (`recurrent`, forward only) from a chunked prefill's state,
    one token and then the rest, each on a twin compiled with small head dims (the same generated code; the
    interpreter's cost grows with K x K states); gates at exactly 0 and far below, and the delta rule's writing
    strengths at 0 and 1; bf16, with the layers' slow gates and with fast-forgetting ones (logsigmoid(N(0, 1)):
    the states keep few keys, where one 10-bit product per operand pair left GKA's solve tokens 100% off).
    Head-first specs slice time on their third axis and skip packing; a GQA split of the heads runs two query
    heads on one key/value head."""

    default_form = "chunk default"
    TWIN_KDIM, TWIN_VDIM = 16, 12
    PACKED = (0, 4, 38, 45)  # three sequences: shorter than a chunk, three chunks from an unaligned start, 7
    SPLIT = 21  # the chained call's first part (not a multiple of any chunk size)

    def condition(self, program: ir.Program, inputs: dict[str, torch.Tensor], generator: torch.Generator | None
                  ) -> dict[str, torch.Tensor]:
        return self.plan.condition_inputs(program, inputs, generator)

    def tolerances(self, case: Case) -> tuple[float, float]:
        """The solve's rounding bounds of the plan (reduced-precision products), at least the defaults."""
        tol, _ = super().tolerances(case)
        if isinstance(self.plan, RecurrencePlan):  # GKA: by the products this op's config gives its solve
            output, gradient = self.plan.bounds(self.op.config.split_products())
        else:
            output, gradient = self.plan.output_tolerance, self.plan.gradient_tolerance
        tol = max(tol, output.get(case.dtype_name, 0.0))
        return tol, max(tol, gradient.get(case.dtype_name, tol))

    def cases(self, dtypes: tuple[torch.dtype, ...]) -> list[Case]:
        out = [Case("chunk default", "normal", FP32), Case("chunk 16", "normal", FP32, True),
               Case("chunk 32", "gates", FP32, True), Case("cu_seqlens", "normal", FP32, True),
               Case("state", "normal", FP32, True)]
        if self._time_dim() == 2:  # packing runs along time in fla's layout only
            out = [c for c in out if c.form != "cu_seqlens"]
        # new cases last: the earlier cases keep their indices, so a seed draws what it drew before
        low = [d for d in dtypes if d != FP32]
        fast = [Case("chunk 16", "fast gates", d, True) for d in low if self._gates()]
        return out + [Case("chunk 16", "normal", d, True) for d in low] + [Case("decode", "normal", FP32, True)] + fast

    def op_for(self, case: Case) -> Op:
        if not case.small:
            return self.op
        r, program = self.plan.roles, self.op.front.program
        sizes = {}
        for axis, size in ((r.kdim, self.TWIN_KDIM), (r.vdim, self.TWIN_VDIM)):
            if (program.axis(axis).fixed or 0) > size:
                sizes[axis] = size
        return self.variant(sizes=sizes)

    def forward_only(self, case: Case) -> bool:
        return case.form == "decode"

    def sizes(self, case: Case, sizes: dict[str, int]) -> dict[str, int]:
        r = self.plan.roles
        if not case.small:  # one sequence per head at the spec's head dims; the twins run two
            return {**sizes, r.batch: 1}
        heads = {r.head: 1, **group_sizes(self.op.front.program, r.head, 2)}  # GQA: one key/value head, 2 groups
        return {**sizes, r.batch: 1 if case.form in ("cu_seqlens", "state", "decode") else 2, **heads,
                r.time: self.PACKED[-1] if case.form == "cu_seqlens" else sizes[r.time]}

    def draw(self, case: Case, inputs: dict[str, torch.Tensor], generator: torch.Generator | None
             ) -> dict[str, torch.Tensor]:
        if case.draw == "fast gates":
            fast = {name: torch.nn.functional.logsigmoid(torch.randn(inputs[name].shape, generator=generator))
                    for name in self._gates()}
            return {**inputs, **{name: g.to(inputs[name].device, inputs[name].dtype) for name, g in fast.items()}}
        if case.draw != "gates":
            return inputs
        lead = (slice(None),) * self._time_dim()
        if isinstance(self.plan, DeltaRulePlan):  # writing strengths exactly 0 (no write) and 1 (replace)
            beta = inputs[self.plan.roles.beta].clone()
            beta[(*lead, slice(2, None, 5))] = 0.0
            beta[(*lead, slice(4, None, 5))] = 1.0
            inputs = {**inputs, self.plan.roles.beta: beta}
        for name in self._gates():
            g = inputs[name].clone()
            if g.dim() == 1:  # a gate per head: the first without decay, the last (of two or more) almost a reset
                g[-1] = -30.0  # (alone, its gradient would be a sum of terms cancelling to ~1e-13: fp32 noise)
                g[0] = 0.0
            else:
                g[(*lead, slice(None, None, 3))] = 0.0  # no decay: exactly 0
                g[(*lead, slice(1, None, 7))] = -30.0  # an almost complete reset
            inputs = {**inputs, name: g}
        return inputs

    def _gates(self) -> set[str]:
        return {self.plan.roles.g, getattr(self.plan.roles, "gk", None)} - {None}

    def _kwargs(self, leaves: dict[str, torch.Tensor], part: slice = slice(None)) -> dict[str, object]:
        r = self.plan.roles
        names = {"q": r.q, "k": r.k, "v": r.v, "g": r.g, "beta": r.beta, "alpha": r.alpha}
        if getattr(r, "h_gate", None) == "gk":  # Gated KalmaNet's covariance with a gate of its own
            names["gk"] = r.gk
        along_time = (slice(None),) * self._time_dim() + (part,)
        return {role: leaves[name][along_time] if leaves[name].dim() > self._time_dim() else leaves[name]
                for role, name in names.items() if name}  # a gate per head (g[head]) has no time

    def _time_dim(self) -> int:
        return 2 if getattr(self.plan.roles, "head_first", False) else 1

    def call(self, op: Op, case: Case, leaves: dict[str, torch.Tensor]) -> torch.Tensor:
        if case.form == "chunk default":
            return super().call(op, case, leaves)
        chunk = op.module.chunk
        if case.form == "cu_seqlens":
            cu = torch.tensor(self.PACKED, dtype=torch.int32, device=leaves[self.plan.roles.q].device)
            return chunk(**self._kwargs(leaves), cu_seqlens=cu, chunk_size=16)[0]
        if case.form in ("state", "decode"):  # a chunked prefill, then the rest from its final state
            first, state = chunk(**self._kwargs(leaves, slice(None, self.SPLIT)), output_final_state=True,
                                 chunk_size=16)
        if case.form == "state":
            second, _ = chunk(**self._kwargs(leaves, slice(self.SPLIT, None)), initial_state=state, chunk_size=16)
            return torch.cat([first, second], dim=self._time_dim())
        if case.form == "decode":  # decoding: one token, then the rest in one call
            one, state = op.module.recurrent(**self._kwargs(leaves, slice(self.SPLIT, self.SPLIT + 1)),
                                             initial_state=state)
            rest, _ = op.module.recurrent(**self._kwargs(leaves, slice(self.SPLIT + 1, None)), initial_state=state)
            return torch.cat([first, one, rest], dim=self._time_dim())
        return chunk(**self._kwargs(leaves), chunk_size=int(case.form.split()[-1]))[0]

    def reference(self, op: Op, case: Case, leaves: dict[str, torch.Tensor]) -> torch.Tensor:
        if case.form != "cu_seqlens":
            return super().reference(op, case, leaves)
        r = self.plan.roles
        pieces = []
        for start, end in zip(self.PACKED, self.PACKED[1:], strict=False):  # each packed sequence on its own
            part = {n: v[:, start:end] if v.dim() > 1 else v for n, v in leaves.items()}
            pieces.append(evaluate(op.front.program, part)[r.output])
        return torch.cat(pieces, dim=1)
