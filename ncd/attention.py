"""Lower a streamable attention spec to the attention kernel family: which input plays q, k, v and the
per-key weight, the mask, the scale, and the kernel's a1, a2, b and derivatives printed from sympy."""

from __future__ import annotations

from dataclasses import dataclass

import sympy

from . import ir
from .errors import NotStreamable
from .streaming import Certificate, X, Z
from .symbolic import triton_expr


class UnsupportedAttention(NotStreamable):
    code = "unsupported"


@dataclass(frozen=True)
class AttentionRoles:
    """Which spec tensors and axes feed the kernel's [B, H, N, D] layout."""

    query: str  # input names
    key: str
    value: str
    weight: str | None
    scale: str | float  # a scalar input's name, or a number
    output: str
    q_axes: tuple[str, str, str, str]  # spec axes playing (batch, head, query, dim) for Q
    k_axes: tuple[str, str, str, str]  # (batch, kv-head, key, dim) for K
    v_axes: tuple[str, str, str, str]
    o_axes: tuple[str, str, str, str]
    weight_axes: tuple[str, str] | None  # (batch, key)
    causal: bool


def _load_of_input(program: ir.Program, node: ir.Node, what: str) -> ir.Load:
    if not (isinstance(node, ir.Load) and program.tensor(node.tensor).role == "in"
            and all(i.axis is not None for i in node.index)):
        raise UnsupportedAttention(node.span, detail=f"the attention kernels read {what} directly from an input "
                                   "tensor", hint=f"make {what} an `in` tensor of the spec")
    return node


def _definition(program: ir.Program, name: str) -> ir.Definition:
    return next(d for d in program.definitions if d.tensor == name)


def _follow(program: ir.Program, node: ir.Node) -> ir.Node:
    while isinstance(node, ir.Load) and program.tensor(node.tensor).role == "let":
        node = _definition(program, node.tensor).value
    return node


def roles(program: ir.Program, cert: Certificate) -> AttentionRoles:
    out = _definition(program, cert.output)
    value = _follow(program, out.value)
    assert isinstance(value, ir.Contract)
    axis = cert.axis
    lhs, rhs = _follow(program, value.lhs), _follow(program, value.rhs)
    weights_node, v_node = (lhs, value.rhs) if _has_aggregate(lhs, axis) else (rhs, value.lhs)
    v = _load_of_input(program, _follow(program, v_node), "V")
    norm = weights_node if isinstance(weights_node, ir.Normalize) else None
    scores = [n for n in _walk(program, weights_node) if isinstance(n, ir.Contract)]
    score = scores[0]
    a, b = _load_of_input(program, _follow(program, score.lhs), "Q"), _load_of_input(
        program, _follow(program, score.rhs), "K")
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
    v_axes = (batch, kv_head, axis, v_dims[0])
    if sympy.simplify(program.axis(v_dims[0]).size - program.axis(dim).size) != 0:
        raise UnsupportedAttention(v.span, detail=f"the attention kernels need V's width '{v_dims[0]}' "
                                   f"({program.axis(v_dims[0]).size}) equal to the head dim '{dim}' "
                                   f"({program.axis(dim).size})", hint=f"declare V over '{dim}'")
    o_tensor = program.tensor(cert.output)
    o_axes = (batch, head, query, v_dims[0])
    if set(o_tensor.axes) != set(o_axes):
        raise UnsupportedAttention(out.span, detail=f"the output must be [{' '.join(o_axes)}] in some order")
    weight, weight_axes, causal = None, None, False
    if norm is not None and norm.weight is not None:
        w = _load_of_input(program, _follow(program, norm.weight), "the per-key weight")
        if set(w.axes) - {batch, axis} or axis not in w.axes:
            raise UnsupportedAttention(w.span, detail=f"the per-key weight must be [{batch} {axis}] or [{axis}]")
        weight, weight_axes = w.tensor, (batch, axis)
    if norm is not None and norm.mask is not None:
        causal = _is_causal(norm.mask, query, axis)
        if not causal:
            raise UnsupportedAttention(norm.mask.span, detail=f"the attention kernels support the causal mask "
                                       f"`{axis} <= {query}` only")
    scale: str | float = str(cert.scale) if cert.scale.is_Symbol else float(cert.scale)
    return AttentionRoles(q.tensor, k.tensor, v.tensor, weight, scale, cert.output,
                          (batch, head, query, dim), k_axes, v_axes, o_axes, weight_axes, causal)


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


def _walk(program: ir.Program, node: ir.Node):
    node = _follow(program, node)
    yield node
    if not isinstance(node, ir.Contract):
        for child in ir.children(node):
            yield from _walk(program, child)


@dataclass(frozen=True)
class KernelMaps:
    """a1, a2, b and the backward's pieces as Triton source, printed from sympy."""

    a1: str
    a2: str
    da1: str
    da2: str
    b: str
    db_over_b: str


def kernel_maps(cert: Certificate) -> KernelMaps:
    d = cert.derivatives()
    for name, expr, var in (("a1", cert.a1, X), ("a2", cert.a2, X), ("b", cert.b, Z)):
        if expr.free_symbols - {var}:
            raise UnsupportedAttention(cert.span, detail=f"{name} uses {expr.free_symbols - {var}}")
    try:
        return KernelMaps(*(triton_expr(e) for e in
                            (cert.a1, cert.a2, d["da1"], d["da2"], cert.b, d["db_over_b"])))
    except ValueError as err:
        raise UnsupportedAttention(cert.span, detail=f"cannot lower to Triton: {err}") from None
