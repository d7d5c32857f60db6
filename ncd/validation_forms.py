"""What `ncd check` runs for each kernel family: every form the generated op can dispatch to at run time,
and input draws that reach the places where kernels go wrong.

A form is selected through the op's public arguments or its module's switches, never by editing code:
    attention  FACTORIZE = "never" | "always"        streamed and factorized forms (NCD_ATTENTION_FACTORIZE)
    recurrence chunk(..., chunk_size, cu_seqlens, initial_state, output_final_state)
    rational   ACCUMULATE = "atomic" | "deterministic"   the coefficient-gradient reductions
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

from . import attention, reference
from .backend import KernelPlan
from .compiler import compile_front
from .ops import Op
from .pipeline import front_end
from .reference import evaluate
from .validate import Case, _Switch

FP32, BF16 = torch.float32, torch.bfloat16
TWIN_DIM = 16  # attention head dim of the cheaper twin
# Attention rows whose normaliser b(z) is below this fraction of the median row's are redrawn in bf16 draws
# (ncd.attention.NEAR_SINGULAR is 1e-3, for fp32). There the backward's dS carries u |dP| / b of rounding in any
# implementation that saves O in bf16 (delta = rowsum(dO * O)); with u = 2^-8 that is 1e-2 and more on a causal
# first row normalised by one small score (measured: dQ 1.4e-2 over the tensor, 0.11 on a row, at one draw of
# causal_gqa_spherical in both forms; at 5e-2, worst rows still reach 3.5e-2 against 4e-2).
NEAR_SINGULAR_LOW_PRECISION = 0.1


def variant(op: Op, sizes: dict[str, int] | None = None, options: dict[str, str] | None = None) -> Op:
    """The same spec text compiled with other fixed sizes or family options (cached beside `op`'s module); `op`
    itself where nothing changes."""
    new_sizes = {**dict(op.front.sizes), **(sizes or {})}
    new_options = {**dict(op.front.options), **(options or {})}
    if new_sizes == dict(op.front.sizes) and new_options == dict(op.front.options):
        return op
    front = front_end(op.front.source.text, op.front.source.filename, new_sizes, new_options)
    return Op(compile_front(front, dict(op.compiled.bindings), cache_dir=op.path.parent))


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

    def sizes(self, case: Case, sizes: dict[str, int]) -> dict[str, int]:
        return sizes

    def switches(self, op: Op, case: Case) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

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


def _zero_rows(t: torch.Tensor, dim: int, every: int) -> torch.Tensor:
    """`t` with every `every`-th slice along `dim` (from the second) set to exactly 0."""
    index = torch.arange(1, t.shape[dim], every)
    out = t.clone()
    out.index_fill_(dim, index.to(t.device), 0)
    return out


def _sprinkle_zeros(t: torch.Tensor, generator: torch.Generator | None, fraction: float = 0.25) -> torch.Tensor:
    keep = torch.rand(t.shape, generator=generator) >= fraction
    return t * keep.to(t.device, t.dtype)


class AttentionForms(Forms):
    """Streamed and (where the maps allow it) factorized forms; large logits, exact zeros (zero query rows
    and keys), zero multiplicities and masked rows (a query that sees no key of nonzero weight)."""

    default_form = "streamed"

    def _forms(self) -> list[str]:
        module = self.op.module
        if not hasattr(module, "FACTORIZE"):
            return ["streamed"]
        dims = [self.op.front.program.axis(self.plan.roles.q_axes[3]).fixed or 16]
        if module.head_tile(dims[0]) > module.FACT_MAX_HEAD_DIM:
            return ["streamed"]
        return ["streamed", "factorized"]

    def cases(self, dtypes: tuple[torch.dtype, ...]) -> list[Case]:
        draws = ["large", "zeros"] + (["masked"] if self.plan.roles.weight else [])
        out = [Case("streamed", "normal", FP32)]
        out += [Case("streamed", d, FP32, True) for d in draws]
        out += [Case("streamed", "normal", d, True) for d in dtypes if d != FP32]
        if "factorized" in self._forms():  # polynomial maps: no overflow to find with large logits
            out += [Case("factorized", d, FP32, True) for d in ["normal", *draws[1:]]]
            out += [Case("factorized", "normal", d, True) for d in dtypes if d != FP32]
        return out

    def op_for(self, case: Case) -> Op:
        """The factorized form, and the streamed form's extra fp32 draws, run on a twin with head dim TWIN_DIM
        (the same generated code; the interpreter's cost grows with the head dim, and with the factorized form's
        [D, 2D] states: 15 s a case at D = 128 on this CPU, about 1 s at 16). The default case and bf16 run at
        the spec's own head dim."""
        dim = self.plan.roles.q_axes[3]
        twin = case.form == "factorized" or (case.small and case.dtype == FP32)
        if not twin or (self.op.front.program.axis(dim).fixed or 0) <= TWIN_DIM:
            return self.op
        return self.variant(sizes={dim: TWIN_DIM})

    def switches(self, op: Op, case: Case) -> contextlib.AbstractContextManager:
        if not hasattr(op.module, "FACTORIZE"):
            return contextlib.nullcontext()
        return _Switch(op.module, {"FACTORIZE": "always" if case.form == "factorized" else "never"})

    def sizes(self, case: Case, sizes: dict[str, int]) -> dict[str, int]:
        if not case.small:
            return sizes
        r = self.plan.roles
        out = dict(sizes)
        if case.form == "factorized":  # three or more chunks of the causal form (CHUNK is 16 in the interpreter)
            chunk = getattr(self.op.module, "CHUNK", 16)
            out[r.q_axes[2]] = max(out[r.q_axes[2]], 2 * chunk + 5)
            out[r.k_axes[2]] = max(out[r.k_axes[2]], 2 * chunk - 3)
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

    def draw(self, case: Case, inputs: dict[str, torch.Tensor], generator: torch.Generator | None
             ) -> dict[str, torch.Tensor]:
        r = self.plan.roles
        if case.dtype != FP32:  # the family's conditioning at bf16's rounding (module switch of ncd.attention)
            with _DictSwitch(vars(attention), {"NEAR_SINGULAR": NEAR_SINGULAR_LOW_PRECISION}):
                inputs = self.plan.condition_inputs(self.op_for(case).front.program, inputs, generator)
        out = dict(inputs)
        if case.draw == "large":  # scores of several hundred: exp(s) overflows fp32 unless stabilised
            out[r.query], out[r.key] = inputs[r.query] * 8, inputs[r.key] * 8
        elif case.draw == "zeros":  # exact zeros: whole query and key rows, and scattered elements
            program = self.op.front.program  # the tensors' declared layouts
            q_dim = program.tensor(r.query).axes.index(r.q_axes[2])
            k_dim = program.tensor(r.key).axes.index(r.k_axes[2])
            out[r.query] = _zero_rows(inputs[r.query], q_dim, 5)
            out[r.key] = _sprinkle_zeros(_zero_rows(inputs[r.key], k_dim, 4), generator)
            if r.weight:  # zero multiplicities, never all of a row's keys
                w_dim = program.tensor(r.weight).axes.index(r.k_axes[2])
                out[r.weight] = _zero_rows(inputs[r.weight], w_dim, 3)
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


class RecurrenceForms(Forms):
    """GKA: the default chunk size at the spec's sizes; chunk sizes 16 and 32 (three and two chunks at 37
    tokens), packed sequences (`cu_seqlens`), and a chained call through `initial_state`/`output_final_state`,
    each on a twin compiled with small head dims (the same generated code; the interpreter's cost grows with
    K x K states); gates at exactly 0 and far below; bf16."""

    default_form = "chunk default"
    TWIN_KDIM, TWIN_VDIM = 16, 12
    PACKED = (0, 4, 38, 45)  # three sequences: shorter than a chunk, three chunks from an unaligned start, 7
    SPLIT = 21  # the chained call's first part (not a multiple of any chunk size)

    def cases(self, dtypes: tuple[torch.dtype, ...]) -> list[Case]:
        out = [Case("chunk default", "normal", FP32), Case("chunk 16", "normal", FP32, True),
               Case("chunk 32", "gates", FP32, True), Case("cu_seqlens", "normal", FP32, True),
               Case("state", "normal", FP32, True)]
        return out + [Case("chunk 16", "normal", d, True) for d in dtypes if d != FP32]

    def op_for(self, case: Case) -> Op:
        if not case.small:
            return self.op
        r, program = self.plan.roles, self.op.front.program
        sizes = {}
        for axis, size in ((r.kdim, self.TWIN_KDIM), (r.vdim, self.TWIN_VDIM)):
            if (program.axis(axis).fixed or 0) > size:
                sizes[axis] = size
        return self.variant(sizes=sizes)

    def sizes(self, case: Case, sizes: dict[str, int]) -> dict[str, int]:
        r = self.plan.roles
        if not case.small:  # one sequence per head at the spec's head dims; the twins run two
            return {**sizes, r.batch: 1}
        return {**sizes, r.batch: 1 if case.form in ("cu_seqlens", "state") else 2, r.head: 1,
                r.time: self.PACKED[-1] if case.form == "cu_seqlens" else sizes[r.time]}

    def draw(self, case: Case, inputs: dict[str, torch.Tensor], generator: torch.Generator | None
             ) -> dict[str, torch.Tensor]:
        if case.draw != "gates":
            return inputs
        g = inputs[self.plan.roles.g].clone()
        g[:, ::3] = 0.0  # no decay: exactly 0
        g[:, 1::7] = -30.0  # an almost complete reset
        return {**inputs, self.plan.roles.g: g}

    def _kwargs(self, leaves: dict[str, torch.Tensor], part: slice = slice(None)) -> dict[str, object]:
        r = self.plan.roles
        names = {"q": r.q, "k": r.k, "v": r.v, "g": r.g, "beta": r.beta, "alpha": r.alpha}
        return {role: leaves[name][:, part] if name else None for role, name in names.items()}

    def call(self, op: Op, case: Case, leaves: dict[str, torch.Tensor]) -> torch.Tensor:
        if case.form == "chunk default":
            return super().call(op, case, leaves)
        chunk = op.module.chunk
        if case.form == "cu_seqlens":
            cu = torch.tensor(self.PACKED, dtype=torch.int32, device=leaves[self.plan.roles.q].device)
            return chunk(**self._kwargs(leaves), cu_seqlens=cu, chunk_size=16)[0]
        if case.form == "state":
            first, state = chunk(**self._kwargs(leaves, slice(None, self.SPLIT)), output_final_state=True,
                                 chunk_size=16)
            second, _ = chunk(**self._kwargs(leaves, slice(self.SPLIT, None)), initial_state=state, chunk_size=16)
            return torch.cat([first, second], dim=1)
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


class _DictSwitch:
    """Sets entries of a dict for the duration of a block (the reference's function table)."""

    def __init__(self, table: dict, values: dict):
        self.table, self.values = table, values
        self.saved: dict = {}

    def __enter__(self) -> None:
        self.saved = {k: self.table[k] for k in self.values}
        self.table.update(self.values)

    def __exit__(self, *exc: object) -> None:
        self.table.update(self.saved)


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

    def switches(self, op: Op, case: Case) -> contextlib.AbstractContextManager:
        return _Switch(op.module, {"ACCUMULATE": case.form})

    def sizes(self, case: Case, sizes: dict[str, int]) -> dict[str, int]:
        return {**sizes, self.plan.roles.row: 37} if case.small else sizes

    def draw(self, case: Case, inputs: dict[str, torch.Tensor], generator: torch.Generator | None
             ) -> dict[str, torch.Tensor]:
        x = self.plan.roles.x
        out = dict(inputs)
        if case.draw == "large":
            out[x] = inputs[x] * 8
        elif case.draw == "zeros":
            out[x] = _sprinkle_zeros(inputs[x], generator)
            for p in self.op.front.program.params:  # KAT's identity init: the denominator starts at 0
                if len(p.axes) > 1:
                    out[p.name] = _zero_rows(inputs[p.name], 0, 2)
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
                with _DictSwitch(reference._UNARY, {"abs": record}):
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
        return _DictSwitch(reference._UNARY, {"abs": _AbsPlus.apply})


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
            return {**inputs, x: _sprinkle_zeros(inputs[x], generator)}
        return inputs


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
            out = {n: _zero_rows(_sprinkle_zeros(v, generator), 0, 3) if v.dim() else v for n, v in out.items()}
        device = next(iter(inputs.values())).device if inputs else "cpu"
        for t in self.op.signature:  # scalars the op needs a value for
            if not t.axes and t.default is None and t.name not in out:
                out[t.name] = torch.randn((), generator=generator).to(device=device, dtype=case.dtype)
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


_FAMILIES = {"attention": AttentionForms, "recurrence": RecurrenceForms, "rational": RationalForms,
             "polykan": PolyKANForms, "generic": GenericForms}


def forms_for(op: Op) -> Forms:
    kernel_plan = op.plan
    return _FAMILIES.get(kernel_plan.family, Forms)(op, kernel_plan)


def describe(cases: list[Case]) -> Iterator[str]:
    for c in cases:
        yield f"{c.label} ({c.dtype_name}{', small' if c.small else ''})"


__all__ = ["Forms", "forms_for", "variant"]
