"""The untyped syntax tree of a spec, straight from the grammar. Names are plain strings with spans;
nothing is resolved here (that is `ncd.lower`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from .source import Source, Span


@dataclass(frozen=True)
class Ident:
    name: str
    span: Span


# --- expressions -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Number:
    value: int | float
    span: Span


@dataclass(frozen=True)
class NameRef:
    name: str
    span: Span


@dataclass(frozen=True)
class IndexName:
    ident: Ident

    @property
    def span(self) -> Span:
        return self.ident.span


@dataclass(frozen=True)
class IndexInt:
    value: int
    span: Span


@dataclass(frozen=True)
class IndexOffset:
    ident: Ident
    offset: int
    span: Span


@dataclass(frozen=True)
class IndexExpr:
    """`T[head, clamp(key - query, -8, 8) + 8]`: an index that is an integer expression (of axis positions, sum
    indices, integer scalar inputs and numbers) rather than a name, a number or NAME+INT."""

    expr: Expr
    span: Span


SimpleIndex = Union[IndexName, IndexInt, IndexOffset]  # what a basis rule's left-hand side takes
Index = Union[IndexName, IndexInt, IndexOffset, IndexExpr]


@dataclass(frozen=True)
class Indexed:
    """`T[i j]`: a tensor (relabelled or indexed by loop variables), or a basis term `T[n-1]`."""

    name: Ident
    indices: tuple[Index, ...]
    span: Span


@dataclass(frozen=True)
class BasisEval:
    """`T[deg](u)`: basis polynomial number `deg` evaluated element-wise at `u`."""

    basis: Ident
    index: tuple[Index, ...]
    arg: Expr
    span: Span


@dataclass(frozen=True)
class Binary:
    op: str  # + - * / ^ < <= > >= == != and or
    lhs: Expr
    rhs: Expr
    span: Span


@dataclass(frozen=True)
class Neg:
    operand: Expr
    span: Span


@dataclass(frozen=True)
class Not:
    """`not COND`: the negation of a condition (a comparison, or and/or/not of comparisons)."""

    operand: Expr
    span: Span


@dataclass(frozen=True)
class Contract:
    """`L . R over a b`: the diagram's cup joining the named wires of both sides."""

    lhs: Expr
    rhs: Expr
    over: tuple[Ident, ...]
    span: Span


@dataclass(frozen=True)
class OverArg:
    axes: tuple[Ident, ...]
    span: Span


@dataclass(frozen=True)
class KeywordArg:
    name: Ident
    value: Expr
    span: Span


@dataclass(frozen=True)
class FunctionArg:
    """`a1(x) = x^2` inside a call: an inline one-argument function."""

    name: Ident
    param: Ident
    body: Expr
    span: Span


@dataclass(frozen=True)
class IntRange:
    lo: int | Ident
    hi: int | Ident
    span: Span


@dataclass(frozen=True)
class AxisRange:
    axis: Ident
    span: Span


@dataclass(frozen=True)
class Comprehension:
    """`body for j in 0..m`: a finite sum's body and index."""

    body: Expr
    var: Ident
    range: IntRange | AxisRange
    span: Span


Arg = Union["Expr", OverArg, KeywordArg, FunctionArg, Comprehension]


@dataclass(frozen=True)
class Call:
    func: Ident
    args: tuple[Arg, ...]
    span: Span


Expr = Union[Number, NameRef, Indexed, BasisEval, Binary, Neg, Not, Contract, Call]


# --- statements --------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpecName:
    name: Ident
    span: Span


@dataclass(frozen=True)
class AxisDecl:
    """kind: 'bound' (size given at call time), 'fixed' (an integer), 'product' (split or alias)."""

    name: Ident
    kind: str
    size: int | None
    factors: tuple[Ident, ...]
    span: Span


@dataclass(frozen=True)
class ConstDecl:
    name: Ident
    value: Expr
    span: Span


@dataclass(frozen=True)
class TensorDecl:
    role: str  # in | param | out
    name: Ident
    axes: tuple[Ident, ...] | None
    dtype: Ident | None
    value: Expr | None  # the defining expression of an `out`, or the default of a scalar `in`
    span: Span


@dataclass(frozen=True)
class Define:
    name: Ident
    axes: tuple[Ident, ...] | None
    value: Expr
    span: Span


@dataclass(frozen=True)
class BasisRule:
    name: Ident
    index: SimpleIndex
    value: Expr
    span: Span


@dataclass(frozen=True)
class BasisDecl:
    name: Ident
    param: Ident
    rules: tuple[BasisRule, ...]
    span: Span


Statement = Union[SpecName, AxisDecl, ConstDecl, TensorDecl, Define, BasisDecl]


@dataclass(frozen=True)
class Module:
    statements: tuple[Statement, ...]
    source: Source
