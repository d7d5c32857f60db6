"""The attention family's plan of a certificate's sink (kernel_sink.py runs it): normalize's `sink = LOGIT`, or the
constant term of b(z) = c z + beta (softmax-plus-one).

The forward (as its first state) and the merge kernel take the sink as `u` per row: with the running max, its
place in the maps' domain t (a2(u) is the entry's share of the sum: u = log(a2_spec(sigma) / C2) / c2 for
a2 = C2 exp(c2 t)); with plain sums, the value a2_spec(sigma) itself, added to z.
`map` prints u from the logit sigma, `dmap` its derivative, for the gradient of a learned logit."""

from __future__ import annotations

from dataclasses import dataclass

import sympy

from ncd import ir
from ncd.errors import NotStreamable
from ncd.stable_exp import stable_triton_expr
from ncd.streaming import FLOAT_DTYPES, Certificate, X
from ncd.symbolic import lambda_to_sympy


class UnsupportedSink(NotStreamable):
    code = "unsupported"


@dataclass(frozen=True)
class SinkPlan:
    tensor: str | None  # the logit tensor (its gradient comes from kernel_sink.gradient), or None: a constant
    dims: tuple[int, ...]  # its dimensions' positions among the kernels' rows (batch 0, head 1, query 2)
    constant: float  # u of a constant sink
    map: str  # Triton text of u(sigma) in `x` ("" for a constant)
    dmap: str
    origin: str
    grad: bool = False  # the tensor is float and takes a gradient

    def describe(self) -> list[str]:
        if self.tensor is None:
            return [f"  sink: a constant entry of the sum with no value, u = {self.constant:g} (kernel_sink.py)"]
        return [f"  sink: logit {self.tensor} per row, u = {self.map} of it, the stream's first state (merged "
                "after split-K decoding: kernel_sink.py); its gradient -a2'(t - m) delta u'(sigma)"]


def plan_sink(program: ir.Program, cert: Certificate, norm: ir.Normalize | None, q_axes: tuple[str, ...]
              ) -> SinkPlan | None:
    if cert.sink is not None:  # b(z) = c z + beta: the maps' own domain, a number
        return SinkPlan(None, (), float(cert.sink), "", "", cert.span.origin)
    node = cert.sink_node
    if node is None or norm is None:
        return None
    axes = {a.name: a for a in program.axes}
    sigma = sympy.Symbol("sigma", real=True)
    a2 = lambda_to_sympy(norm.a2, X, axes).subs(X, sigma)
    if cert.rescale is not None:  # the entry's place t in the maps' domain, a2_t(t) = C2 exp(c2 t) = a2(sigma)
        c2 = cert.rescale.c2
        log_c2 = sympy.log(cert.a2.subs(X, 0))
        u = sympy.simplify((sympy.expand_log(sympy.log(a2), force=True) - log_c2) / c2)
    else:
        u = a2
    if u.free_symbols - {sigma}:
        raise UnsupportedSink(node.span, detail=f"the sink's share a2(sink) = {a2} reads "
                              f"{sorted(map(str, u.free_symbols - {sigma}))}", hint="give a2 numbers only")
    if isinstance(node, ir.Const) or (not node.axes and not any(isinstance(n, ir.Load | ir.AxisIndex)
                                                                  for n in ir.walk(node))):
        value = _number(program, node)
        return SinkPlan(None, (), float(u.subs(sigma, value)), "", "", node.span.origin)
    rows = {q_axes[0]: 0, q_axes[1]: 1, q_axes[2]: 2}
    if not isinstance(node, ir.Load) or program.tensor(node.tensor).role not in ("in", "param") \
            or any(i.axis not in rows for i in node.index):
        raise UnsupportedSink(node.span, detail="the attention kernels take a sink that is a number or an input "
                              f"tensor over [{' '.join(q_axes[:3])}] (any of them, e.g. one logit per head)",
                              hint="declare the logits as `param sink[head] : f32` and write `sink = sink`")
    tensor = program.tensor(node.tensor)
    try:
        text = stable_triton_expr(u.subs(sigma, X), X)
        dtext = stable_triton_expr(sympy.diff(u, sigma).subs(sigma, X), X)
    except ValueError as err:
        raise UnsupportedSink(node.span, detail=f"cannot lower the sink's map to Triton: {err}") from None
    return SinkPlan(node.tensor, tuple(rows[i.axis] for i in node.index if i.axis is not None), 0.0, text, dtext,
                    node.span.origin, tensor.dtype in FLOAT_DTYPES)


def _number(program: ir.Program, node: ir.Node) -> float:
    from ncd.symbolic import to_sympy

    value = to_sympy(node, {a.name: a for a in program.axes}, {})
    if value.free_symbols or not value.is_real:
        raise UnsupportedSink(node.span, detail=f"the sink {value} is not a number",
                              hint="a sink is a number or an input tensor")
    return float(value)
