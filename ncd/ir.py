"""The axis-typed IR: a spec's wires, each with named axes whose sizes are known (an integer) or bound at
call time (a sympy symbol). Nodes are frozen dataclasses carrying the span they came from; `Program.verify()`
re-checks the invariants every pass must keep, and `Program.graph()` is the dataflow view."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, fields, replace
from typing import Any, Union

import networkx as nx
import sympy

from .source import NO_SPAN, Source, Span

DTYPES = ("f16", "bf16", "f32", "f64", "i32", "i64", "bool")
FLOAT_DTYPES = DTYPES[:4]
ELEMENTWISE = ("abs", "sign", "exp", "log", "sqrt", "tanh", "sigmoid", "sin", "cos", "acos")
COMPARISONS = ("<", "<=", ">", ">=", "==", "!=")
LOGICAL = ("and", "or")  # of two conditions; `not` is Unary("not", ...)


class IRVerificationError(AssertionError):
    """An IR invariant is broken: a compiler bug, never a user mistake."""


@dataclass(frozen=True)
class Axis:
    name: str
    size: sympy.Expr  # Integer, or a product of positive-integer Symbols bound at call time
    factors: tuple[str, ...] = ()  # a split axis, outer factor first: chan = group * width
    alias_of: str | None = None  # `axis kcol = kdim`: a distinct wire of the same size
    span: Span = NO_SPAN

    @property
    def fixed(self) -> int | None:
        return int(self.size) if self.size.is_Integer else None


@dataclass(frozen=True)
class Tensor:
    name: str
    role: str  # in | param | out | let
    axes: tuple[str, ...]
    dtype: str | None  # None: computed in fp32, stored in the output's dtype
    span: Span
    default: Node | None = None  # scalar inputs only


# --- wires (expression nodes) ------------------------------------------------------------------
# Each node has `axes` (the named wires it carries, in order) and `span`; `boolean` marks conditions (masks):
# comparisons, and/or of conditions (Binary), not of a condition (Unary).


@dataclass(frozen=True)
class Const:
    value: float
    span: Span
    name: str | None = None  # the spec constant it came from, for printing
    axes: tuple[str, ...] = ()


@dataclass(frozen=True)
class SizeOf:
    axis: str
    span: Span
    axes: tuple[str, ...] = ()


@dataclass(frozen=True)
class LoadIndex:
    """How a tensor dimension is addressed: by a wire axis (possibly relabelled), or by an integer
    expression of finite-sum variables (a sympy expression)."""

    axis: str | None
    index: sympy.Expr | None = None


@dataclass(frozen=True)
class Load:
    tensor: str
    index: tuple[LoadIndex, ...]
    axes: tuple[str, ...]
    span: Span


@dataclass(frozen=True)
class AxisIndex:
    """The position along an axis, as a number: masks such as `key <= query`."""

    axis: str
    span: Span

    @property
    def axes(self) -> tuple[str, ...]:
        return (self.axis,)


@dataclass(frozen=True)
class Var:
    """A scalar variable: a finite-sum index, an inline function's parameter, or a basis argument."""

    name: str
    span: Span
    axes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Unary:
    fn: str  # neg, not (of a condition), or one of ELEMENTWISE
    arg: Node
    axes: tuple[str, ...]
    span: Span

    @property
    def boolean(self) -> bool:
        return self.fn == "not"


@dataclass(frozen=True)
class Binary:
    op: str  # + - * / max min, a comparison < <= > >= == !=, or and/or of two conditions
    lhs: Node
    rhs: Node
    axes: tuple[str, ...]
    span: Span

    @property
    def boolean(self) -> bool:
        return self.op in COMPARISONS or self.op in LOGICAL


@dataclass(frozen=True)
class Pow:
    base: Node
    exponent: sympy.Expr  # an integer, possibly in finite-sum variables
    axes: tuple[str, ...]
    span: Span


@dataclass(frozen=True)
class Where:
    cond: Node
    then: Node
    otherwise: Node
    axes: tuple[str, ...]
    span: Span


@dataclass(frozen=True)
class FiniteSum:
    var: str
    lo: int
    hi: int  # inclusive
    body: Node
    axes: tuple[str, ...]
    span: Span


@dataclass(frozen=True)
class Reduce:
    op: str  # sum | max
    over: tuple[str, ...]
    arg: Node
    axes: tuple[str, ...]
    span: Span


@dataclass(frozen=True)
class Contract:
    lhs: Node
    rhs: Node
    over: tuple[str, ...]
    axes: tuple[str, ...]
    span: Span


@dataclass(frozen=True)
class Lambda:
    """A scalar function of one variable (normalize's a1, a2, b)."""

    param: str
    body: Node
    span: Span
    axes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Normalize:
    """N(x)_i = w_i a1(x_i) / b(sum_j w_j a2(x_j) + a2(sink)) over one axis, entries outside `mask` excluded; the
    sink (a logit over the other axes, or none) is one more entry with no value (attention sinks)."""

    arg: Node
    over: str
    a1: Lambda
    a2: Lambda
    b: Lambda
    mask: Node | None
    weight: Node | None
    axes: tuple[str, ...]
    span: Span
    sink: Node | None = None


@dataclass(frozen=True)
class BasisEval:
    basis: str
    index: str | sympy.Expr  # an axis (the degree runs along it) or a finite-sum expression
    arg: Node
    axes: tuple[str, ...]
    span: Span


@dataclass(frozen=True)
class BasisTerm:
    """T[n - back] inside a basis recurrence."""

    back: int
    span: Span
    axes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Prev:
    """The scanned state one step earlier along the scan axis (the initial state at step 0)."""

    axes: tuple[str, ...]
    span: Span


@dataclass(frozen=True)
class Scan:
    over: str
    body: Node
    init: Node | None
    axes: tuple[str, ...]
    span: Span


@dataclass(frozen=True)
class ChebyshevSolve:
    """x with sum_c A[r, c] x[c] = b[r], by `iterations` Chebyshev steps on the spectrum [mu, L]."""

    matrix: Node
    rhs: Node
    row: str
    over: str
    iterations: int
    mu: Node
    lipschitz: Node
    axes: tuple[str, ...]
    span: Span


Node = Union[
    Const, SizeOf, Load, AxisIndex, Var, Unary, Binary, Pow, Where, FiniteSum, Reduce, Contract, Lambda,
    Normalize, BasisEval, BasisTerm, Prev, Scan, ChebyshevSolve,
]


def children(node: Node) -> Iterator[Node]:
    for f in fields(node):
        value = getattr(node, f.name)
        if isinstance(value, Node.__args__):  # type: ignore[attr-defined]
            yield value


def substitute(node: Node, name: str, value: Node) -> Node:
    """`node` with every Var(name) replaced by `value` (an inline function's body composed with another's)."""
    if isinstance(node, Var) and node.name == name:
        return value
    changes: dict[str, Any] = {f.name: substitute(v, name, value) for f in fields(node)
                               if isinstance(v := getattr(node, f.name), Node.__args__)}  # type: ignore[attr-defined]
    return replace(node, **changes) if changes else node


def walk(node: Node) -> Iterator[Node]:
    yield node
    for child in children(node):
        yield from walk(child)


def inline(program: Program, node: Node) -> Node:
    """Follow loads of intermediates (read whole, not relabelled) to their definitions."""
    while isinstance(node, Load) and program.tensor(node.tensor).role == "let":
        if tuple(i.axis for i in node.index) != program.tensor(node.tensor).axes:
            return node
        node = program.definition(node.tensor).value
    return node


def walk_inlined(program: Program, node: Node) -> Iterator[Node]:
    """Every node below `node`, looking through loads of intermediates; contractions are leaves."""
    node = inline(program, node)
    yield node
    if not isinstance(node, Contract):
        for child in children(node):
            yield from walk_inlined(program, child)


@dataclass(frozen=True)
class Basis:
    """A polynomial family by its recurrence: P_0..P_{k-1} given, P_{n+1} from P_n, P_{n-1}, ..."""

    name: str
    param: str
    initial: tuple[Node, ...]
    step: Node  # in Var(param), Var('n') and BasisTerm(back)
    step_var: str
    span: Span


@dataclass(frozen=True)
class Definition:
    tensor: str
    value: Node
    span: Span


@dataclass(frozen=True)
class Program:
    name: str
    axes: tuple[Axis, ...]
    tensors: tuple[Tensor, ...]
    definitions: tuple[Definition, ...]  # in dependency order
    bases: tuple[Basis, ...]
    constants: tuple[tuple[str, float], ...]
    source: Source = field(compare=False, repr=False)

    def axis(self, name: str) -> Axis:
        return {a.name: a for a in self.axes}[name]

    def tensor(self, name: str) -> Tensor:
        return {t.name: t for t in self.tensors}[name]

    def definition(self, name: str) -> Definition:
        return next(d for d in self.definitions if d.tensor == name)

    @property
    def inputs(self) -> tuple[Tensor, ...]:
        return tuple(t for t in self.tensors if t.role == "in")

    @property
    def params(self) -> tuple[Tensor, ...]:
        return tuple(t for t in self.tensors if t.role == "param")

    @property
    def outputs(self) -> tuple[Tensor, ...]:
        return tuple(t for t in self.tensors if t.role == "out")

    def graph(self) -> nx.DiGraph:
        """Dataflow: an edge t -> d when definition d reads tensor t."""
        g = nx.DiGraph()
        for t in self.tensors:
            g.add_node(t.name, role=t.role, axes=t.axes)
        for d in self.definitions:
            for node in walk(d.value):
                if isinstance(node, Load):
                    g.add_edge(node.tensor, d.tensor)
        return g

    def verify(self) -> None:
        from .verify import verify_program

        verify_program(self)
