"""Lower a streamable attention spec to the attention kernel family: which input plays q, k, v and the
per-key weight, the mask, the scale, and the kernel's a1, a2, b and derivatives printed from sympy."""

from __future__ import annotations

import ast
from dataclasses import dataclass, replace

import sympy

from ncd import ir
from ncd.cost import (
    AttentionShape,
    Estimate,
    FormEstimate,
    factorized_estimate,
    format_estimate,
    format_forms,
    kernel_head_dim,
    rank_configs,
)
from ncd.errors import NotStreamable
from ncd.families.attention.config import DEFAULT_FORWARD_TILES, MEASURED_FORWARD_TILES, AttentionConfig
from ncd.families.attention.factorize import Factorization, factorize
from ncd.families.attention.modifiers import BATCH, KEY, QUERY, Modifiers
from ncd.families.attention.modifiers import NONE as NO_MODIFIERS
from ncd.families.attention.modifiers import derive as derive_modifiers
from ncd.families.attention.prologue import Transform, drawn_input, operand, transforms
from ncd.families.attention.sinks import SinkPlan, UnsupportedSink, plan_sink
from ncd.family import Decline
from ncd.pipeline import FrontEnd
from ncd.stable_exp import stable_triton_expr
from ncd.streaming import Certificate, X, Z, certify, collapse_chain


class UnsupportedAttention(NotStreamable):
    code = "unsupported"


@dataclass(frozen=True)
class AttentionRoles:
    """Which spec tensors and axes feed the kernel's [B, H, N, D] layout."""

    query: str  # input names
    key: str
    value: str
    weight: str | None
    scale: str | float  # host Python text of the scale (scalar inputs by name, axis sizes from `_sizes`), or a number
    output: str
    q_axes: tuple[str, str, str, str]  # spec axes playing (batch, head, query, dim) for Q
    k_axes: tuple[str, str, str, str]  # (batch, kv-head, key, dim) for K
    v_axes: tuple[str, str, str, str]
    o_axes: tuple[str, str, str, str]
    weight_axes: tuple[str, str] | None  # (batch, key)
    causal: bool  # the plain causal mask `key <= query`, which the kernels' CAUSAL flag handles
    scale_inputs: tuple[str, ...] = ()  # the scalar inputs the scale reads
    mask: ir.Node | None = None  # any other mask (or causal with a score modifier): a hook (modifiers.py)
    prologue: tuple[Transform, ...] = ()  # operands the op computes before the kernels (prologue.py)


def _load_of_input(program: ir.Program, node: ir.Node, what: str) -> ir.Load:
    if not (isinstance(node, ir.Load) and program.tensor(node.tensor).role == "in"
            and all(i.axis is not None for i in node.index)):
        raise UnsupportedAttention(node.span, detail=f"the attention kernels read {what} directly from an input "
                                   "tensor", hint=f"make {what} an `in` tensor of the spec, or compute it in a named "
                                   "intermediate from inputs (a prologue: ncd/families/attention/prologue.py)")
    return node


def roles(program: ir.Program, cert: Certificate) -> AttentionRoles:
    out = program.definition(cert.output)
    value = ir.inline(program, out.value)
    assert isinstance(value, ir.Contract)
    axis = cert.axis
    lhs, rhs = ir.inline(program, value.lhs), ir.inline(program, value.rhs)
    weights_node, v_node = (lhs, value.rhs) if _has_aggregate(lhs, axis) else (rhs, value.lhs)
    v = operand(program, v_node, "V")
    norm = collapse_chain(program, weights_node) if isinstance(weights_node, ir.Normalize) else None
    scores = [n for n in ir.walk_inlined(program, weights_node) if isinstance(n, ir.Contract)]
    score = scores[0]
    a, b = operand(program, score.lhs, "Q"), operand(program, score.rhs, "K")
    q, k = (a, b) if axis in b.axes else (b, a)
    (dim,) = score.over
    row_axes = [x for x in q.axes if x not in k.axes and x != dim and not _factor_in(program, x, k.axes)]
    if len(row_axes) != 1:
        raise UnsupportedAttention(score.span, detail=f"Q must carry exactly one query axis that K lacks; found "
                                   f"{row_axes}")
    query = row_axes[0]
    shared = [x for x in q.axes if x not in (query, dim)]
    if len(shared) != 2:
        raise UnsupportedAttention(q.span, detail=f"the attention kernels take Q as [batch head query dim]; "
                                   f"'{q.tensor}' has axes [{' '.join(q.axes)}]")
    split = [x for x in shared if program.axis(x).factors]
    head = split[0] if split else shared[1]
    batch = next(x for x in shared if x != head)
    kv_head = head if head in k.axes else program.axis(head).factors[0]
    if kv_head not in k.axes or (program.axis(head).factors and program.axis(head).factors[0] != kv_head):
        raise UnsupportedAttention(k.span, detail=f"K must carry '{head}' or its outer factor (grouped heads)")
    k_axes = (batch, kv_head, axis, dim)
    v_dims = [x for x in v.axes if x not in (batch, kv_head, axis)]
    if set(k.axes) != set(k_axes) or len(v_dims) != 1 or len(v.axes) != 4:
        raise UnsupportedAttention(k.span, detail="K and V must be [batch head key dim] (any order)")
    v_axes = (batch, kv_head, axis, v_dims[0])  # (V's width may differ from the head dim: HEAD_DIM_V in kernel.py)
    o_tensor = program.tensor(cert.output)
    o_axes = (batch, head, query, v_dims[0])
    if set(o_tensor.axes) != set(o_axes):
        raise UnsupportedAttention(out.span, detail=f"the output must be [{' '.join(o_axes)}] in some order")
    weight, weight_axes, causal, mask = None, None, False, None
    if norm is not None and norm.weight is not None:
        w = _load_of_input(program, ir.inline(program, norm.weight), "the per-key weight")
        if set(w.axes) - {batch, axis} or axis not in w.axes:
            raise UnsupportedAttention(w.span, detail=f"the per-key weight must be [{batch} {axis}] or [{axis}]")
        weight, weight_axes = w.tensor, (batch, axis)
    if norm is not None and norm.mask is not None:
        causal = _is_causal(norm.mask, query, axis) and cert.modifier is None
        mask = None if causal else norm.mask
    scale, scale_inputs = _host_scale(program, cert)
    prologue = transforms(program, {"Q": q, "K": k, "V": v}, {"Q": dim, "K": dim, "V": v_dims[0]})
    return AttentionRoles(q.tensor, k.tensor, v.tensor, weight, scale, cert.output,
                          (batch, head, query, dim), k_axes, v_axes, o_axes, weight_axes, causal, scale_inputs, mask,
                          prologue)


def _host_scale(program: ir.Program, cert: Certificate) -> tuple[str | float, tuple[str, ...]]:
    """The score's scale as host Python text over the scalar inputs and `_sizes[axis]`, or a number."""
    from sympy.printing.pycode import PythonCodePrinter

    expr = cert.scale
    if not expr.free_symbols:
        return float(expr), ()
    sizes = {a.size: a.name for a in program.axes if isinstance(a.size, sympy.Symbol)}
    inputs = {t.name for t in program.inputs if not t.axes}
    used: list[str] = []
    for symbol in sorted(expr.free_symbols, key=str):
        if symbol not in sizes:
            if symbol.name not in inputs:
                raise UnsupportedAttention(cert.span, detail=f"the scale {expr} reads '{symbol}', which is neither "
                                           "a scalar input nor an axis size")
            used.append(symbol.name)

    class _Printer(PythonCodePrinter):
        def _print_Symbol(self, symbol: sympy.Symbol) -> str:
            return f'_sizes["{sizes[symbol]}"]' if symbol in sizes else symbol.name

    text = _Printer({"fully_qualified_modules": True}).doprint(expr)
    return text, tuple(used)


def _is_causal(mask: ir.Node, query: str, key: str) -> bool:
    if not isinstance(mask, ir.Binary) or not isinstance(mask.lhs, ir.AxisIndex) \
            or not isinstance(mask.rhs, ir.AxisIndex):
        return False
    pair = (mask.lhs.axis, mask.op, mask.rhs.axis)
    return pair in ((key, "<=", query), (query, ">=", key))


def _factor_in(program: ir.Program, axis: str, axes: tuple[str, ...]) -> bool:
    return any(f in axes for f in program.axis(axis).factors)


def _has_aggregate(node: ir.Node, axis: str) -> bool:
    return isinstance(node, ir.Normalize) or any(
        isinstance(n, ir.Reduce) and axis in n.over for n in ir.walk(node))


@dataclass(frozen=True)
class KernelMaps:
    """a1, a2, b and the backward's pieces as Triton source, printed from sympy."""

    a1: str
    a2: str
    da1: str
    da2: str
    b: str
    db_over_b: str
    pre: str = ""  # the stabiliser's pre-map h of the score and h' ("": none, h = x)
    dpre: str = ""


def kernel_maps(cert: Certificate) -> KernelMaps:
    d = cert.derivatives()
    for name, expr, var in (("a1", cert.a1, X), ("a2", cert.a2, X), ("b", cert.b, Z), ("h", cert.pre, X)):
        if expr.free_symbols - {var}:
            extra = ", ".join(sorted(map(str, expr.free_symbols - {var})))
            raise UnsupportedAttention(cert.span, detail=f"{name} = {expr} reads {extra} (an axis size or a scalar "
                                       "input), which the kernels' maps cannot take: they are compiled before the "
                                       "call's sizes and scalars are known",
                                       hint="fix that axis's size in the spec, or move the factor into the score's "
                                       "scale")
    try:  # printed so that no exponential overflows where the map's value is finite (ncd/stable_exp.py)
        maps = [stable_triton_expr(e, v) for e, v in ((cert.a1, X), (cert.a2, X), (d["da1"], X), (d["da2"], X),
                                                       (cert.b, Z), (d["db_over_b"], Z))]
        if cert.pre != X:
            maps += [stable_triton_expr(cert.pre, X), stable_triton_expr(d["dpre"], X)]
        return KernelMaps(*maps)
    except ValueError as err:
        raise UnsupportedAttention(cert.span, detail=f"cannot lower to Triton: {err}") from None


def _same_expression(text: str, other: str) -> bool:
    """Equal as Python expressions (spacing and redundant parentheses ignored)."""
    return ast.dump(ast.parse(text.strip(), mode="eval")) == ast.dump(ast.parse(other.strip(), mode="eval"))


def attention_config(maps: KernelMaps, online_max: bool, forward_tiles: tuple[tuple[int, ...], ...] = (),
                     factorization: Factorization | None = None, score_modifier: bool = False) -> AttentionConfig:
    """The knobs the plan decides: the forward's autotune set (the cost ranking, else the measured default), the
    accumulation (running max; exp2 where a1 = a2 = a1' = a2' = exp and no pre-map takes the score first; a1 = a2
    evaluated once; the backward's statistics folded where a1 = a2 = a1' = a2' = exp), the factorized form's
    presence and head-dim limit (its chunk: the platform's, config.py), and what NCD_* settings fill
    (`AttentionConfig.with_settings`)."""
    fold = online_max and all(_same_expression(e, "tl.exp(x)") for e in (maps.a1, maps.a2, maps.da1, maps.da2))
    exp2 = fold and not maps.pre and not score_modifier
    shared = _same_expression(maps.a1, maps.a2) and _same_expression(maps.da1, maps.da2)
    config = AttentionConfig(forward_tiles=tuple(forward_tiles) or DEFAULT_FORWARD_TILES, online_max=online_max,
                             exp2=exp2, shared_map=shared, fold=fold).with_settings()
    if factorization is None:
        return config
    return replace(config, factorized=True, fact_max_head_dim=factorization.max_head_dim)


DEFAULT_CONFIG = AttentionConfig()


# Axis sizes the plan is estimated at unless the caller binds them: the benchmark's attention setting.
DEFAULT_BINDINGS = {"batch": 8, "head": 16, "query": 4096, "key": 4096}
DTYPE_BYTES = {"f16": 2, "bf16": 2, "f32": 4, "f64": 8}


@dataclass(frozen=True)
class AttentionPlan:
    family = "attention"
    certificate: Certificate
    roles: AttentionRoles
    maps: KernelMaps
    bindings: dict[str, int]
    estimates: tuple[Estimate, ...]
    factorization: Factorization | None = None
    shape: AttentionShape | None = None
    factorized_cost: FormEstimate | None = None
    config: AttentionConfig = DEFAULT_CONFIG
    modifiers: Modifiers = NO_MODIFIERS
    sink: SinkPlan | None = None

    def _padding(self) -> list[str]:
        dim = self.bindings.get(self.roles.q_axes[3])
        if self.shape is None or dim is None or dim == self.shape.head_dim:
            return []
        return [f"  head dim: {dim}, tiled as {self.shape.head_dim} (the kernels mask the columns past {dim}: loads "
                "read zeros, stores skip them; costs below are at the tile)"]

    def describe(self) -> list[str]:
        r = self.roles
        lines = [*self.certificate.describe(), "kernel family: normalized-contraction attention",
                 f"  Q = {r.query}[{' '.join(r.q_axes)}]  K = {r.key}[{' '.join(r.k_axes)}]  "
                 f"V = {r.value}[{' '.join(r.v_axes)}]  -> {r.output}[{' '.join(r.o_axes)}]",
                 *(t.describe() for t in r.prologue),
                 f"  scale: {self.certificate.scale if isinstance(r.scale, str) else r.scale}   causal: {r.causal}   "
                 f"per-key weight: {r.weight or 'none'}",
                 *self.modifiers.describe(),
                 *(self.sink.describe() if self.sink is not None else []),
                 f"  triton: a1 = {self.maps.a1};  a2 = {self.maps.a2};  b = {self.maps.b}",
                 f"          a1' = {self.maps.da1};  a2' = {self.maps.da2};  b'/b = {self.maps.db_over_b}",
                 *([f"          pre-map h = {self.maps.pre};  h' = {self.maps.dpre}"] if self.maps.pre else []),
                 "  accumulators: o in registers (fp32), z (and m) per row in registers; no atomics "
                 "(one program owns each query tile; the backward's dK/dV programs own key tiles)",
                 *self._padding(),
                 "cost (per tile config, forward) at "
                 + " ".join(f"{k}={v}" for k, v in self.bindings.items()) + ":"]
        for e in self.estimates:
            lines += ["  " + line for line in format_estimate(e)]
        lines.append(f"autotune set: {len(self.estimates)} configs above (pruned from the candidates by "
                     "SMEM and register capacity, ranked by the roofline estimate)")
        if self.factorization is not None:
            f = self.factorization
            lines += f.describe()
            if self.shape is not None and self.factorized_cost is not None and self.estimates:
                s = self.shape
                reduced = s.n_query * s.n_key / (s.n_query + s.n_key)
                chosen = f.chosen(s.n_query, s.n_key, s.head_dim)
                rule = (f"Nq Nk / (Nq + Nk) = {reduced:g} {'>' if chosen else '<='} {f.crossover:g} * D = "
                        f"{f.crossover * s.head_dim:g}")
                if s.head_dim > f.max_head_dim:
                    rule = f"head-dim tile {s.head_dim} > {f.max_head_dim}: the [D, D] states do not fit in SMEM"
                lines += format_forms(self.estimates[0], self.factorized_cost, chosen, rule)
        else:
            lines.append("forms: streamed only (the factorized form needs a1, a2 polynomials of degree <= 1, <= 2)")
        return [*lines, *self.config.describe()]

    @property
    def output(self) -> str:
        return self.roles.output

    def render(self, program: ir.Program, op_id: str) -> str:
        from ncd.families.attention.render_op import render_attention_op

        return render_attention_op(program, self.certificate, self.roles, self.maps, op_id,
                                   self.config.forward_tiles, self.factorization, config=self.config,
                                   modifiers=self.modifiers, sink=self.sink)

    def constant_inputs(self) -> frozenset[str]:
        """The per-key weight and the modifiers' integer tensors (lengths, segment ids, ...)."""
        weight = {self.roles.weight} if self.roles.weight else set()
        if self.sink is not None and self.sink.tensor is not None and not self.sink.grad:
            weight.add(self.sink.tensor)
        return frozenset(weight | {t.name for t in self.modifiers.tensors if not t.float} | set(self.modifiers.scalars))

    def validation_sizes(self, program: ir.Program) -> dict[str, int]:
        """Odd sizes: 37 queries, 29 keys; 2 K/V heads with 2 query heads each where heads are grouped."""
        r = self.roles
        sizes = {r.q_axes[0]: 2, r.q_axes[2]: 37, r.k_axes[2]: 29}
        head, kv_head = r.q_axes[1], r.k_axes[1]
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


    def condition_inputs(self, program: ir.Program, inputs: dict, generator=None) -> dict:
        """Redraws query rows whose normaliser b(z) sits near a zero of b: below NEAR_SINGULAR of the median row's.
        There the backward's dS carries a rounding error of u |dP| / b in any implementation, the float64
        reference's own fp32 evaluation included, so such a draw would measure the maths, not the kernel (a causal
        first row normalises by one score: b = |s|). Softmax-like rescaled rows and a b without a zero keep
        their draw."""
        import torch

        from ncd.reference import evaluate

        if self.certificate.rescale is not None or self.certificate.b.subs(Z, 0) != 0:
            return inputs
        q_name, q_dim = drawn_input(self.roles.prologue, self.roles.query), self.roles.q_axes[3]
        if q_name is None:  # q computed by a prologue from several inputs: no one input row to redraw
            return inputs
        q_axes = program.tensor(q_name).axes
        out = dict(inputs)
        for _ in range(REDRAWS):
            found: list = []
            evaluate(program, {n: v.cpu() for n, v in out.items()}, normalisers=found)  # (the reference's own
            # positions and defaults are CPU tensors)
            b = found[0]
            rows = [a for a in q_axes if a != q_dim]
            if sorted(b.axes) != sorted(rows):
                return out  # rows that Q does not index one to one (never for the specs the roles accept)
            size = b.data.abs()
            near = (size < NEAR_SINGULAR * size.median()).permute([b.axes.index(a) for a in rows])
            if not near.any():
                return out
            q = out[q_name]
            fresh = torch.randn(q.shape, generator=generator, dtype=torch.float32).to(q.device, q.dtype)
            out[q_name] = torch.where(near.unsqueeze(q_axes.index(q_dim)).to(q.device), fresh, q)
        return out


# Validation redraws a query row whose |b(z)| is below this fraction of the median row's (at 1e-3 the fp32
# gradients stay near 5e-6 against a 1e-4 tolerance; at 1e-4, 3e-5 both from the kernels and from PyTorch's fp32
# autograd of the reference); REDRAWS bounds the loop for rows no redraw helps.
NEAR_SINGULAR = 1e-3
REDRAWS = 20


def plan_attention(front: FrontEnd, bindings: dict[str, int]) -> AttentionPlan | Decline:
    """The attention family claims specs whose output is a streamable normalized contraction."""
    program = front.program
    certificates = certify(program)
    if not certificates:
        last = program.definition(program.outputs[-1].name) if program.outputs else None
        return Decline("no definition contracts a normalized map over one axis (normalize(a(S), over AXIS) . V)",
                       last.span if last is not None else None)
    cert = certificates[0]
    r = roles(program, cert)
    maps = kernel_maps(cert)
    modifiers = derive_modifiers(program, cert, r.q_axes, r.k_axes, r.mask)
    sink = plan_sink(program, cert, _normalize_of(program, cert), r.q_axes)
    if sink is not None and sink.tensor in {t.name for t in modifiers.tensors}:
        raise UnsupportedSink(cert.span, detail=f"'{sink.tensor}' is both the sink and read by the score or mask")
    sizes = {**DEFAULT_BINDINGS, **bindings}
    bound = {}
    for axis in program.axes:
        bound[axis.name] = axis.fixed or sizes.get(axis.name) or sizes.get(_role_name(r, axis.name), 1024)
    q_tensor = program.tensor(r.query)
    heads = bound[r.q_axes[1]]
    shape = AttentionShape(
        batch_heads=bound[r.q_axes[0]] * heads,
        kv_heads_ratio=heads // max(1, bound[r.k_axes[1]]),
        n_query=bound[r.q_axes[2]], n_key=bound[r.k_axes[2]], head_dim=kernel_head_dim(bound[r.q_axes[3]]),
        value_dim=kernel_head_dim(bound[r.v_axes[3]]), elem_bytes=DTYPE_BYTES.get(q_tensor.dtype or "bf16", 2),
        causal=r.causal,
    )
    shown = {a: bound[a] for a in dict.fromkeys((*r.q_axes, *r.k_axes, *r.v_axes))}
    # (the factorized form reassociates the contractions, which a modifier or a mask other than causal breaks; its
    # [D, 2D] states need V as wide as Q and K)
    value_width = sympy.simplify(program.axis(r.v_axes[3]).size - program.axis(r.q_axes[3]).size) != 0
    factorization = None if modifiers.has_mask or value_width or sink is not None else factorize(cert, r.causal)
    factorized_cost = factorized_estimate(shape, factorization.chunk) if factorization is not None else None
    estimates = tuple(rank_configs(shape))
    tiles = tuple((e.config.block_m, e.config.block_n, e.config.num_warps, e.config.num_stages) for e in estimates)
    config = attention_config(maps, cert.rescale is not None, tiles, factorization, modifiers.has_score)
    if modifiers.has_mask and modifiers.hides:  # the dQ-from-dS kernel would read tiles the ranges never wrote
        config = replace(config, ds_buffer_bytes=0)
    if batch_shared_table(modifiers):
        best = (*config.forward_tiles[:HEADS_FAST_TILES], *MEASURED_FORWARD_TILES)
        config = replace(config, forward_tiles=config.forward_tiles + heads_fast(best))
    return AttentionPlan(cert, r, maps, shown, estimates, factorization, shape, factorized_cost, config, modifiers,
                         sink)


# A [.., query, key] table that the batch shares (an additive bias [head, query, key]) is read again by every batch
# entry: in the forward's default grid order the same head's rows return after every other head's, past the L2 (bias
# [16, 1k, 1k] fp32 is 64 MiB; H100, N 1k, B 32: 0.68x Flex's forward, bench/log/2026-11-26-issue32-s6.md). Grids
# with the batch * heads axis fast bring a tile's batch entries together; the autotuner gets heads-fast copies of the
# best-ranked and the measured forward tiles to measure beside the others.
HEADS_FAST_TILES = 3


def batch_shared_table(modifiers: Modifiers) -> bool:
    """Whether a modifier tensor has query and key dimensions and no batch dimension (a table of positions read at
    an index expression, T5's, is small: not this)."""
    return any(QUERY in t.roles and KEY in t.roles and BATCH not in t.roles for t in modifiers.tensors)


def heads_fast(tiles: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
    """The tiles with the heads-fast grid order (each once)."""
    return tuple(dict.fromkeys((*t[:4], 1) for t in tiles))


def _normalize_of(program: ir.Program, cert: Certificate) -> ir.Normalize | None:
    value = ir.inline(program, program.definition(cert.output).value)
    assert isinstance(value, ir.Contract)
    for side in (value.lhs, value.rhs):
        node = ir.inline(program, side)
        if isinstance(node, ir.Normalize):
            return collapse_chain(program, node)
    return None


def _role_name(r: AttentionRoles, axis: str) -> str:
    names = dict(zip(r.q_axes, ("batch", "head", "query", "dim"), strict=True))
    names.update(zip(r.k_axes, ("batch", "head", "key", "dim"), strict=True))
    return names.get(axis, axis)
