"""What `ncd check` runs for attention: the streamed and factorized forms and draws that reach large logits,
exact zeros and masked rows."""

from __future__ import annotations

import math

import torch

from ncd import ir
from ncd.family import KernelPlan
from ncd.ops import Op
from ncd.validate import Case
from ncd.validation_forms import FP32, DictSwitch, Forms, sprinkle_zeros, zero_rows

from . import plan, prologue

TWIN_DIM = 16  # attention head dim of the cheaper twin
# Attention rows whose normaliser b(z) is below this fraction of the median row's are redrawn in bf16 draws
# (plan.NEAR_SINGULAR is 1e-3, for fp32). There the backward's dS carries u |dP| / b of rounding in any implementation
# that saves O in bf16 (delta = rowsum(dO * O)); with u = 2^-8 that is 1e-2 and more on a causal
# first row normalised by one small score (measured: dQ 1.4e-2 over the tensor, 0.11 on a row, at one draw of
# causal_gqa_spherical in both forms; at 5e-2, worst rows still reach 3.5e-2 against 4e-2).
NEAR_SINGULAR_LOW_PRECISION = 0.1
# Gradients of score-modifier tensors (ALiBi slopes, temperatures, biases) in bf16 draws: dslope = sum_ij dS_ij (j - i)
# sums a whole head's scores, and with softmax sum_j dS_ij = 0, so it cancels. PyTorch's own bf16 autograd of the
# same formula (eager, against float64, 37 causal queries, 2 heads, D 128) was off by 1.3e-3 to 0.14 over five draws
# (median 2.7e-2); the kernels measured 2.8e-2.
MODIFIER_GRAD_TOLERANCE_LOW_PRECISION = 0.15
# The same sums in fp32: dtau = sum_ij dS'_ij x_ij is a covariance under the softmax (sum_j dS'_ij = 0) and cancels
# where tau is small. The kernels' delta_i = dO_i . O_i (FlashAttention's) does not cancel in it: 4.3e-4 at one
# draw, where PyTorch's fp32 autograd of the formula (which forms sum_j P dP) stayed below 1.5e-5 over 20 draws. A
# known gap (the note); checked at this tolerance meanwhile.
MODIFIER_GRAD_TOLERANCE = 2e-3
# A sink's logit in bf16 draws: d sink_h = -sum_i P_sink,i delta_i sums signed rows of a whole head, and cancels.
# PyTorch's bf16 eager softmax with the sink as one more column (fp32 softmax, 37 causal queries, 2 heads, D 64)
# missed the float64 value by 3.9e-4 to 9.4e-3 over eight draws; the kernels measured 1.1e-2 at one (2x eager's
# worst: the tolerance).
SINK_GRAD_TOLERANCE_LOW_PRECISION = 2e-2
# The large draw multiplies q (its even rows) and k, or what a prologue scales, by LARGE_FACTOR, or by less where
# that would take the largest visible score past LARGE_SCORE: far past fp32's exp overflow (88), inside float64's
# (709) with room for the reference's sums. At a unit temperature (learned_temperature_softmax: tau drawn N(0, 1))
# a factor of 8 gave scores of several thousand and an infinite reference.
LARGE_FACTOR = 8.0
LARGE_SCORE = 300.0
# ... and judges each row against the RMS row norm itself, as bf16 draws do (fp32's floor is 0.25 of it). A saturated
# row's dS is ~0 in float64, and u |dO| |v| in the kernels, whose delta is dO . O (FlashAttention's): times the
# scaled q that is 8e-6 in dK, 8e-4 of a quarter of the RMS row at padded_softmax's 3 live rows (seed 2). Overflow,
# what the draw looks for, is off by far more.
LARGE_ROW_FLOOR = 1.0
# bf16 draws scale q and k down where the largest visible score passes LOW_PRECISION_SCORE (a 1 / sqrt(d) softmax
# of unit-normal q and k peaks near 4): bf16 gradients of a sharply peaked softmax miss the 1e-2 tolerance in any
# implementation. At a unit temperature (scores to about 40), PyTorch's eager bf16 autograd of
# learned_temperature_softmax missed float64 by 3.3e-2 in dK (median of 8 draws, 0.12 at worst), the kernels by
# 8e-3 to 2.5e-2; capped at 12, the kernels reached 9.3e-3, at 8 6.1e-3 to 7.0e-3 (plain softmax: 6.1e-3 to 6.4e-3).
# Large logits are the fp32 large draw's (LARGE_SCORE).
LOW_PRECISION_SCORE = 8.0
# An integer scalar that a mask reads (a window) is drawn at this value, so that it cuts the small odd sizes.
MASK_SCALAR = 5


class AttentionForms(Forms):
    """Streamed and (where the maps allow it) factorized forms; large logits, exact zeros (zero query rows
    and keys), zero multiplicities and masked rows (a query that sees no key of nonzero weight)."""

    default_form = "streamed"

    def __init__(self, op: Op, kernel_plan: KernelPlan):
        super().__init__(op, kernel_plan)
        if self.plan.factorization is not None and self.plan.config.factorize == "always":
            self.default_form = "factorized"  # `validate` runs the op as configured

    def _forms(self) -> list[str]:
        module = self.op.module
        if self.plan.factorization is None:
            return ["streamed"]
        dims = [self.op.front.program.axis(self.plan.roles.q_axes[3]).fixed or 16]
        if module.head_tile(dims[0]) > module.FACT_MAX_HEAD_DIM:
            return ["streamed"]
        return ["streamed", "factorized"]

    def _mask_inputs(self, inputs: dict[str, torch.Tensor], generator: torch.Generator | None
                     ) -> dict[str, torch.Tensor]:
        """Integer mask tensors drawn to cut the small sizes: per-token ids (documents) as sorted runs of uneven
        length, one of them a single token; per-batch or per-head values (lengths, prefixes) in [0, N], one of them
        0 (a fully masked row) where the batch or heads allow two; integer scalars (a window) at MASK_SCALAR."""
        program = self.op.front.program
        # one run of ids over the longer sequence, read by every per-token tensor at its positions: query i and key
        # i are one token (self-attention over packed documents), so documents share rows and columns
        n_tokens = max((v.shape[max(t.roles.index(r) for r in ("i", "j") if r in t.roles)]
                        for t in self.plan.modifiers.tensors if not t.float and {"i", "j"} & set(t.roles)
                        for v in [inputs[t.name]]), default=0)
        ids = torch.zeros(0, dtype=torch.long)
        if n_tokens:  # (no draw at all for specs without such tensors: their seeds keep their inputs)
            starts = torch.rand(n_tokens, generator=generator) < 0.08  # documents of ~12 tokens, and one of 1
            starts[0] = False
            if n_tokens > 3:
                starts[2:4] = True  # a document of one token (tokens 2 and 3 start new ones)
            ids = starts.long().cumsum(0)
        for t in self.plan.modifiers.tensors:
            if t.float or t.name not in inputs:
                continue
            value = inputs[t.name]
            if {"i", "j"} & set(t.roles):
                dim = t.roles.index("i" if "i" in t.roles else "j")
                shape = [1] * value.dim()
                shape[dim] = value.shape[dim]
                inputs[t.name] = ids[:value.shape[dim]].view(shape).expand(value.shape).to(value.device,
                                                                                           value.dtype).clone()
            else:
                n = max(self.plan.validation_sizes(program).get(a, 0) for a in
                        (self.plan.roles.q_axes[2], self.plan.roles.k_axes[2]))
                drawn = torch.randint(2, n + 1, value.shape, generator=generator)  # (not 1: see "masked" below)
                if drawn.numel() > 1:
                    drawn.view(-1)[0] = 0
                inputs[t.name] = drawn.to(value.device, value.dtype)
        for name in self.plan.modifiers.scalars:
            if program.tensor(name).dtype not in ir.FLOAT_DTYPES:
                inputs[name] = torch.tensor(float(MASK_SCALAR))
        return inputs

    def cases(self, dtypes: tuple[torch.dtype, ...]) -> list[Case]:
        masked_rows = self.plan.roles.weight or any(not t.float for t in self.plan.modifiers.tensors) or any(
            self.op.front.program.tensor(n).dtype not in ir.FLOAT_DTYPES
            for n in self.plan.modifiers.scalars)
        draws = ["large", "zeros"] + (["masked"] if masked_rows else [])
        out = [Case("streamed", "normal", FP32)]
        out += [Case("streamed", d, FP32, True) for d in draws]
        out += [Case("streamed", "normal", d, True) for d in dtypes if d != FP32]
        # split-K decoding: the key axis split across programs, merged by the certificate (small sizes: several
        # splits of the interpreter's key blocks)
        out += [Case("decode", d, FP32, True) for d in ["normal", *draws[2:]]]
        if "factorized" in self._forms():  # polynomial maps: no overflow to find with large logits
            out += [Case("factorized", d, FP32, True) for d in ["normal", *draws[1:]]]
            out += [Case("factorized", "normal", d, True) for d in dtypes if d != FP32]
        return out

    def op_for(self, case: Case) -> Op:
        """The factorized form, and the streamed form's extra fp32 draws, run on a twin with head dim TWIN_DIM
        (the same generated code; the interpreter's cost grows with the head dim, and with the factorized form's
        [D, 2D] states: 15 s a case at D = 128 on this CPU, about 1 s at 16). The default case and bf16 run at
        the spec's own head dim. Each form runs on an op compiled to take it at every call (`_in_form`)."""
        dim = self.plan.roles.q_axes[3]
        twin = case.form == "factorized" or (case.small and case.dtype == FP32)
        op = self.op
        if twin and (self.op.front.program.axis(dim).fixed or 0) > TWIN_DIM:
            op = self.variant(sizes={dim: TWIN_DIM})
        if case.form == "decode":  # split-K decoding (kernel_decode.py) at every call
            return self._configured(op, decode="always")
        # (the other forms run as configured: at these sizes, far from kernel_decode.use_decode's, "auto" never
        # decodes)
        if self.plan.factorization is None:
            return op
        return self._configured(op, factorize="always" if case.form == "factorized" else "never")

    def _configured(self, op: Op, **fields: str) -> Op:
        """`op` compiled to take one form at every call (config fields `factorize`, `decode`: always | never)."""
        if all(getattr(op.config, name) == value for name, value in fields.items()):
            return op
        key = f"{op.compiled.op_id} " + " ".join(f"{n}={v}" for n, v in sorted(fields.items()))
        if key not in self._variants:
            self._variants[key] = op.with_config(**fields)
        return self._variants[key]

    def sizes(self, case: Case, sizes: dict[str, int]) -> dict[str, int]:
        if not case.small:
            return sizes
        r = self.plan.roles
        out = dict(sizes)
        if case.form == "factorized":  # three or more chunks of the causal form (CHUNK is 16 in the interpreter)
            chunk = self.op_for(case).module.CHUNK  # the factorized op's keys per chunk
            out[r.q_axes[2]] = max(out[r.q_axes[2]], 2 * chunk + 5)
            out[r.k_axes[2]] = max(out[r.k_axes[2]], 2 * chunk - 3)
        if case.form == "decode":  # a few queries against three splits of four 16-key blocks, the last ragged
            out[r.q_axes[2]], out[r.k_axes[2]] = 5, 3 * 4 * 16 - 5
        out[r.q_axes[0]] = 1
        head, kv_head = r.q_axes[1], r.k_axes[1]
        if head == kv_head:
            out[head] = 2
        else:  # one K/V head read by two query heads
            out[kv_head] = 1
            for f in self.op.front.program.axis(head).factors:
                out[f] = 2 if f != kv_head else 1
            out[head] = 2
        return out

    def gradient_tolerance(self, case: Case, name: str, default: float) -> float:
        if case.dtype != FP32 and any(name in t.reads for t in self.plan.roles.prologue):
            return max(default, prologue.GRAD_TOLERANCE_LOW_PRECISION)  # (measured there)
        sink = self.plan.sink
        if case.dtype != FP32 and sink is not None and name == sink.tensor:
            return max(default, SINK_GRAD_TOLERANCE_LOW_PRECISION)
        grads = {t.name for t in self.plan.modifiers.grad_tensors}
        if name not in grads:
            return default
        return MODIFIER_GRAD_TOLERANCE_LOW_PRECISION if case.dtype != FP32 else max(default, MODIFIER_GRAD_TOLERANCE)

    @staticmethod
    def _score_factor(program: ir.Program, inputs: dict[str, torch.Tensor], names, factor: float, peak: float
                      ) -> float:
        """`factor`, or the factor that brings the largest visible score to `peak` where `factor` would take it past
        (the scores' degree in the factor read off the reference at 1 and at 8: 2 for q . k)."""
        from ncd.reference import evaluate

        def largest(f: float) -> float:
            found: list[torch.Tensor] = []
            scaled = {n: (v.float() * f if n in names else v).detach().cpu() for n, v in inputs.items()}
            with torch.no_grad():
                evaluate(program, scaled, scores=found)
            return max((float(s.abs().max()) for s in found if s.numel()), default=0.0)

        base = largest(1.0)
        at = largest(factor) if factor != 1.0 else base
        if at <= peak or base <= 0:
            return factor
        probe = largest(8.0)
        degree = math.log(probe / base) / math.log(8.0) if probe > base else 0.0
        return (peak / base) ** (1 / degree) if degree > 0 else factor

    def row_floor(self, case: Case) -> float:
        """Large draws judge each row against the RMS row itself (LARGE_ROW_FLOOR)."""
        return max(super().row_floor(case), LARGE_ROW_FLOOR) if case.draw == "large" else super().row_floor(case)

    def call(self, op: Op, case: Case, leaves: dict[str, torch.Tensor]) -> torch.Tensor:
        """The tensors positionally, and the mask's integer scalars (drawn: `draw`) by name."""
        scalars = {n: leaves[n] for n in self.plan.modifiers.scalars if n in leaves}
        return op(*[leaves[t.name] for t in op.signature if t.axes], **{n: float(v) for n, v in scalars.items()})

    def condition(self, program: ir.Program, inputs: dict[str, torch.Tensor], generator: torch.Generator | None
                  ) -> dict[str, torch.Tensor]:
        return self.plan.condition_inputs(program, inputs, generator)

    def draw(self, case: Case, inputs: dict[str, torch.Tensor], generator: torch.Generator | None
             ) -> dict[str, torch.Tensor]:
        r = self.plan.roles
        if case.dtype != FP32:  # the family's conditioning at bf16's rounding (a module switch of plan)
            with DictSwitch(vars(plan), {"NEAR_SINGULAR": NEAR_SINGULAR_LOW_PRECISION}):
                inputs = self.plan.condition_inputs(self.op_for(case).front.program, inputs, generator)
        out = self._mask_inputs(dict(inputs), generator)
        if case.dtype != FP32 and case.draw == "normal":  # practical scores (LOW_PRECISION_SCORE)
            names = prologue.scaled_inputs(r.prologue, (r.query, r.key), self.op.front.program)
            # (and the score modifier's float tensors: an ALiBi slope drawn at 1 moves a score by 1 per key)
            names += [t.name for t in self.plan.modifiers.tensors if t.float and t.in_score and t.name not in names]
            factor = self._score_factor(self.op_for(case).front.program, out, names, 1.0, LOW_PRECISION_SCORE)
            for name in names:
                out[name] = (out[name].float() * factor).to(out[name].dtype)
        if case.draw == "large":  # scores of several hundred: exp(s) overflows fp32 unless stabilised
            # (where a prologue computes q or k, the inputs it reads: a normalised q is scale-free, its gains are not)
            names = prologue.scaled_inputs(r.prologue, (r.query, r.key), self.op.front.program)
            program = self.op_for(case).front.program
            factor = self._score_factor(program, out, names, LARGE_FACTOR, LARGE_SCORE)
            for name in names:
                out[name] = inputs[name] * factor
            if r.query in names:  # q's odd rows unscaled: their scores, x factor, stay short of saturating
                # (a saturated softmax row has gradients of ~0, where the rounding of any fp32 implementation reads as
                # a large relative error once every row saturates: 4e-4 at padded_softmax's 5 live rows)
                rows = program.tensor(r.query).axes.index(r.q_axes[2])
                odd = torch.arange(1, inputs[r.query].shape[rows], 2, device=inputs[r.query].device)
                out[r.query] = out[r.query].index_copy(rows, odd, inputs[r.query].index_select(rows, odd))
        elif case.draw == "zeros":  # exact zeros: whole query and key rows, and scattered elements
            program = self.op.front.program  # the tensors' declared layouts
            # (where a prologue computes q or k, the input it transforms: prologue.drawn_input)
            q_in, k_in = prologue.drawn_input(r.prologue, r.query), prologue.drawn_input(r.prologue, r.key)
            if q_in is not None:
                out[q_in] = zero_rows(inputs[q_in], program.tensor(q_in).axes.index(r.q_axes[2]), 5)
            if k_in is not None:
                k_dim = program.tensor(k_in).axes.index(r.k_axes[2])
                out[k_in] = sprinkle_zeros(zero_rows(inputs[k_in], k_dim, 4), generator)
            if r.weight:  # zero multiplicities, never all of a row's keys
                w_dim = program.tensor(r.weight).axes.index(r.k_axes[2])
                out[r.weight] = zero_rows(inputs[r.weight], w_dim, 3)
        elif case.draw == "masked" and not r.weight:  # the mask's own masked rows: lengths of 0, two-key windows
            # (not one key: a row that sees a single key has dQ = dK = 0 exactly, and fp32's rounding of dP - delta
            # against a float64 zero is no measure of the kernels)
            program = self.op.front.program
            for t in self.plan.modifiers.tensors:
                if not t.float and not {"i", "j"} & set(t.roles):
                    out[t.name] = torch.zeros_like(out[t.name])
            for name in self.plan.modifiers.scalars:
                if program.tensor(name).dtype not in ir.FLOAT_DTYPES:
                    out[name] = torch.tensor(2.0)
        elif case.draw == "masked":  # rows with no visible key of nonzero weight: output 0, no gradient
            w_axes = self.op.front.program.tensor(r.weight).axes
            w = inputs[r.weight].clone()
            if r.causal:  # the first queries see only the first keys
                w.narrow(w_axes.index(r.k_axes[2]), 0, 3).zero_()
            elif r.k_axes[0] in w_axes:  # the first batch has no key at all
                w.narrow(w_axes.index(r.k_axes[0]), 0, 1).zero_()
            else:
                w.zero_()
            out[r.weight] = w
        return out
