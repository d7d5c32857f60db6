"""Tensor reads at an integer expression of positions: `table[head, clamp(key - query, -16, 16) + 16]`.

An index entry that is neither an axis name (relabelling) nor a number or finite-sum index (`j`, `j+1`) is an
*index expression*: arithmetic (`+ - *`, `/` and `^` of integers, `floor`) of axis positions, finite-sum indices,
integer scalar inputs, constants and `size(AXIS)`, with `min`, `max`, `clamp`, `abs`, `log` and
`where(COND, A, B)`. It lowers to the sympy expression an `ir.LoadIndex` holds (`axis` None), in which the position
along axis `a` is `Position(a)`, a sum index or an integer scalar input is `Symbol(name, integer=True)`, and a
call-time size is the axis's size symbol. A load whose index reads positions carries those axes as wires
(`load_axes`): `table[head, key - query]` carries `[head query key]`, and its value there is a gather.

The compiler proves every such index inside its axis (`index_range`: interval arithmetic over the positions'
ranges, a where's branch under its condition); an index it cannot prove in range is a located error, so no
family, kernel or reference ever reads outside a tensor. The value is computed in float64 with the same torch
calls by the reference (`gather`) and the generic family (`emit_gather`), so both read the same entries.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import sympy
import torch
from sympy.core.relational import Relational
from sympy.logic.boolalg import BooleanFalse, BooleanTrue

from . import ast, ir
from .errors import IndexOutOfRange, TypeMismatch, UnknownName
from .source import Span

if TYPE_CHECKING:
    from .lower import _ExprLowering


class Position(sympy.Symbol):
    """The position along an axis inside an index expression: never equal to the axis's size symbol of the same
    name, nor to a sum index."""


def position(axis: str) -> Position:
    return Position(axis, integer=True, nonnegative=True)


class IndexNotProven(IndexOutOfRange):
    template = ("index {index} of '{name}' is not provably inside axis '{axis}' of size {size}: the compiler bounds "
                "it by [{lo}, {hi}]")


FUNCTIONS = ("min", "max", "clamp", "floor", "abs", "log", "where", "size")
HINT = ("an index is an integer expression of axis positions, sum indices, integer scalar inputs, constants and "
        "size(AXIS), with + - * / ^, " + ", ".join(f"{f}(...)" for f in FUNCTIONS))


# --- lowering (ncd.lower calls this for every index entry that is not a name, a number or NAME+-INT) ---------------


def lower_index(lowering: _ExprLowering, index: ast.Index, tensor: str, axis: ir.Axis) -> sympy.Expr:
    """The sympy form of one index entry of `tensor` along `axis`, checked to be an integer provably inside the
    axis (a located error otherwise)."""
    expr = _as_expr(index)
    value = _IndexLowering(lowering).walk(expr)
    text = _spec_text(lowering, index.span)
    if not integer_valued(value):
        raise TypeMismatch(index.span, detail=f"the index {text} of '{tensor}' may not be an integer",
                           hint="round a division or a log down with floor(...)")
    names = {a: ir_axis.size for a, ir_axis in lowering.o.axes.items()}
    variables = {k: v for k, v in lowering.scope.variables.items() if v is not None}
    lo, hi, exact = index_range(value, names, variables)
    size = axis.size
    if _provably(lo >= 0) and _provably(size - 1 - hi >= 0):
        return value
    if exact and (_provably(lo < 0) or _provably(hi > size - 1)):
        reach = lo if _provably(lo < 0) else hi
        raise IndexOutOfRange(index.span, index=text, name=tensor, value=_readable(reach), axis=axis.name,
                              size=_readable(size), hint=f"clamp it: clamp({text}, 0, {_readable(size - 1)})")
    raise IndexNotProven(index.span, index=text, name=tensor, axis=axis.name, size=_readable(size),
                         lo=_readable(lo), hi=_readable(hi),
                         hint=f"clamp it (clamp({text}, 0, {_readable(size - 1)})), or bound what it reads: the "
                              "compiler must prove every index inside its axis")


def integer_valued(e: sympy.Expr) -> bool:
    """Whether `e` is an integer for every integer value of its symbols (sympy cannot tell through a where)."""
    if e.is_integer or isinstance(e, sympy.floor | sympy.ceiling):  # floor(log(0)) is no integer: index_range
        return True                                                  # bounds it by -oo, an error
    if isinstance(e, sympy.Piecewise):
        return all(integer_valued(value) for value, _ in e.args)
    if isinstance(e, sympy.Add | sympy.Mul | sympy.Min | sympy.Max):
        return all(integer_valued(a) for a in e.args)
    return False


def _as_expr(index: ast.Index) -> ast.Expr:
    if isinstance(index, ast.IndexExpr):
        return index.expr
    if isinstance(index, ast.IndexInt):
        return ast.Number(index.value, index.span)
    name = ast.NameRef(index.ident.name, index.ident.span)
    if isinstance(index, ast.IndexName):
        return name
    number = ast.Number(abs(index.offset), index.span)
    return ast.Binary("+" if index.offset >= 0 else "-", name, number, index.span)


def _spec_text(lowering: _ExprLowering, span: Span) -> str:
    """The index as written (one line of spec text), for messages in the spec's own words."""
    source = lowering.o.module.source
    lines = [source.line(n) for n in range(span.line, span.end_line + 1)]
    lines[-1] = lines[-1][:span.end_col - 1]
    lines[0] = lines[0][span.col - 1:]
    return " ".join(" ".join(lines).split()) or "?"


class _IndexLowering:
    """AST -> sympy for an index expression; every leaf resolved as `ncd.lower` resolves names."""

    def __init__(self, lowering: _ExprLowering) -> None:
        self.lowering = lowering
        self.o = lowering.o
        self.scope = lowering.scope

    def walk(self, e: ast.Expr) -> Any:
        method = getattr(self, f"_{type(e).__name__}", None)
        if method is None:
            raise TypeMismatch(e.span, detail="this cannot be part of an index", hint=HINT)
        return method(e)

    def _Number(self, e: ast.Number) -> sympy.Expr:
        return _exact(e.value)

    def _NameRef(self, e: ast.NameRef) -> sympy.Expr:
        name = e.name
        if name in self.scope.variables:
            if self.scope.variables[name] is None:
                raise TypeMismatch(e.span, detail=f"'{name}' cannot index a tensor here")
            return sympy.Symbol(name, integer=True)
        kind = self.o.decls.get(name, ("",))[0]
        if kind == "axis":
            if self.scope.scalar_only:
                raise TypeMismatch(e.span, detail=f"axis '{name}' cannot be used in {self.scope.scalar_only}",
                                   hint=f"for its size write size({name})")
            return position(name)
        if kind == "const":
            value = self.lowering.sub(e)
            assert isinstance(value, ir.Const)
            return _exact(value.value)
        if kind == "tensor" and name in self.o.tensors:
            tensor = self.o.tensors[name]
            if tensor.role != "in" or tensor.axes or tensor.dtype not in ("i32", "i64"):
                what = (f"'{name}' is {tensor.dtype or 'computed'}" if not tensor.axes and tensor.role == "in"
                        else f"'{name}' is a tensor (reading one tensor at another's values is not supported)")
                raise TypeMismatch(e.span, detail=f"an index reads integer scalar inputs; {what}", hint=HINT)
            self.lowering.sub(e)  # marks it used, and checks it is allowed here
            return sympy.Symbol(name, integer=True)
        self.lowering.sub(e)  # raises the usual located error (unknown name, basis, prev)
        raise UnknownName(e.span, name=name, choices=list(self.o.axes))  # pragma: no cover - sub() raised

    def _Neg(self, e: ast.Neg) -> sympy.Expr:
        return -self.walk(e.operand)

    def _Binary(self, e: ast.Binary) -> Any:
        lhs, rhs = self.walk(e.lhs), self.walk(e.rhs)
        if e.op in ("and", "or"):
            for side, node in ((lhs, e.lhs), (rhs, e.rhs)):
                if not _is_condition(side):
                    raise TypeMismatch(node.span, detail=f"'{e.op}' combines conditions (comparisons, and/or/not), "
                                       "not numbers", hint="compare first: x > 0 and y > 0")
            return (sympy.And if e.op == "and" else sympy.Or)(lhs, rhs)
        for side, node in ((lhs, e.lhs), (rhs, e.rhs)):
            if _is_condition(side):
                raise TypeMismatch(node.span, detail="a condition cannot be used as a number",
                                   hint="write where(COND, 1, 0)")
        if e.op in ir.COMPARISONS:
            return _RELATIONS[e.op](lhs, rhs)
        if e.op == "^":
            if not (rhs.is_Integer and abs(int(rhs)) <= 64):
                raise TypeMismatch(e.rhs.span, detail="a power in an index takes an integer exponent of at most 64")
            return lhs ** rhs
        return _ARITHMETIC[e.op](lhs, rhs)

    def _Not(self, e: ast.Not) -> Any:
        arg = self.walk(e.operand)
        if not _is_condition(arg):
            raise TypeMismatch(e.operand.span, detail="'not' takes a condition, not a number")
        return sympy.Not(arg)

    def _Call(self, e: ast.Call) -> Any:
        fn = e.func.name
        if fn not in FUNCTIONS:
            raise TypeMismatch(e.func.span, detail=f"'{fn}' cannot be used in an index", hint=HINT)
        if fn == "size":
            node = self.lowering.sub(e)
            assert isinstance(node, ir.SizeOf)
            return self.o.axes[node.axis].size
        arity = {"min": 2, "max": 2, "clamp": 3, "where": 3}.get(fn, 1)
        if len(e.args) != arity or any(isinstance(a, ast.OverArg | ast.KeywordArg | ast.FunctionArg
                                                  | ast.Comprehension) for a in e.args):
            detail = "reductions (over ...) cannot be part of an index" if fn in ("min", "max") else ""
            raise TypeMismatch(e.span, detail=f"{fn}() in an index takes {arity} positional argument"
                               f"{'s' if arity > 1 else ''}" + (f"; {detail}" if detail else ""))
        args = [self.walk(a) for a in e.args]  # type: ignore[arg-type]
        if fn == "where":
            if not _is_condition(args[0]):
                raise TypeMismatch(e.args[0].span, detail="where()'s first argument must be a comparison (or and/or/"
                                   "not of comparisons)")
            return sympy.Piecewise((args[1], args[0]), (args[2], True))
        for value, arg in zip(args, e.args, strict=True):
            if _is_condition(value):
                raise TypeMismatch(arg.span, detail="a condition cannot be used as a number",
                                   hint="write where(COND, 1, 0)")
        if fn == "clamp":
            return sympy.Min(sympy.Max(args[0], args[1]), args[2])
        if fn in ("min", "max"):
            return (sympy.Min if fn == "min" else sympy.Max)(*args)
        return {"floor": sympy.floor, "abs": sympy.Abs, "log": sympy.log}[fn](args[0])


def _is_condition(value: object) -> bool:
    return isinstance(value, Relational | sympy.And | sympy.Or | sympy.Not | BooleanTrue | BooleanFalse)


_RELATIONS = {"<": sympy.Lt, "<=": sympy.Le, ">": sympy.Gt, ">=": sympy.Ge, "==": sympy.Eq, "!=": sympy.Ne}
_ARITHMETIC: dict[str, Callable[[Any, Any], Any]] = {
    "+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "/": lambda a, b: a / b,
}


def _exact(value: float) -> sympy.Expr:
    return sympy.Integer(int(value)) if value == int(value) else sympy.Rational(str(value))


# --- the range an index takes -------------------------------------------------------------------------------------

Interval = tuple[sympy.Expr, sympy.Expr]


def index_range(expr: sympy.Expr, sizes: Mapping[str, sympy.Expr],
                variables: Mapping[str, tuple[int, int]]) -> tuple[sympy.Expr, sympy.Expr, bool]:
    """Bounds [lo, hi] of `expr` over every position (axis `a` in [0, sizes[a] - 1]), finite-sum index (its range)
    and scalar input (unbounded), by interval arithmetic; a where's branch is bounded under its condition (a
    comparison of a subexpression with a number). `exact` when the bounds are attained: every symbol occurs once
    and no where is involved (then a bound outside the axis is reached by some position)."""
    lo, hi = _Bounds(sizes, variables).of(expr, {})
    symbols = [s for s in sympy.preorder_traversal(expr) if isinstance(s, sympy.Symbol) and not s.is_positive]
    exact = len(symbols) == len(set(symbols)) and not expr.has(sympy.Piecewise)
    return lo, hi, exact


class _Bounds:
    def __init__(self, sizes: Mapping[str, sympy.Expr], variables: Mapping[str, tuple[int, int]]) -> None:
        self.sizes, self.variables = sizes, variables

    def of(self, e: sympy.Expr, facts: Mapping[sympy.Expr, Interval]) -> Interval:
        lo, hi = self._of(e, facts)
        if e in facts:
            lo, hi = _max(lo, facts[e][0]), _min(hi, facts[e][1])
        return lo, hi

    def _of(self, e: sympy.Expr, facts: Mapping[sympy.Expr, Interval]) -> Interval:
        oo = sympy.oo
        if e.is_number and e.is_finite:
            return e, e
        if isinstance(e, Position):
            return sympy.Integer(0), self.sizes[e.name] - 1
        if isinstance(e, sympy.Symbol):
            if e.name in self.variables and not e.is_positive:
                lo, hi = self.variables[e.name]
                return sympy.Integer(lo), sympy.Integer(hi)
            if e.is_positive:  # a call-time size
                return e, e
            return -oo, oo  # a scalar input
        parts = [self.of(a, facts) for a in e.args] if not isinstance(e, sympy.Piecewise) else []
        if isinstance(e, sympy.Add):
            return sympy.Add(*[p[0] for p in parts]), sympy.Add(*[p[1] for p in parts])
        if isinstance(e, sympy.Mul):
            out = parts[0]
            for p in parts[1:]:
                out = _times(out, p)
            return out
        if isinstance(e, sympy.Pow) and e.exp.is_Integer:
            return _power(parts[0], int(e.exp))
        if isinstance(e, sympy.Min | sympy.Max):
            pick = _min if isinstance(e, sympy.Min) else _max
            lo, hi = parts[0]
            for p in parts[1:]:
                lo, hi = pick(lo, p[0]), pick(hi, p[1])
            return lo, hi
        if isinstance(e, sympy.floor | sympy.ceiling):
            return type(e)(parts[0][0]), type(e)(parts[0][1])
        if isinstance(e, sympy.Abs):
            lo, hi = parts[0]
            if _provably(lo >= 0):
                return lo, hi
            if _provably(hi <= 0):
                return -hi, -lo
            return sympy.Integer(0), _max(-lo, hi)
        if isinstance(e, sympy.log):
            lo, hi = parts[0]
            return (sympy.log(lo) if _provably(lo > 0) else -oo), (sympy.log(hi) if _provably(hi > 0) else -oo)
        if isinstance(e, sympy.Piecewise):
            return self._piecewise(e, facts)
        return -oo, oo

    def _piecewise(self, e: sympy.Piecewise, facts: Mapping[sympy.Expr, Interval]) -> Interval:
        los, his = [], []
        earlier: list[sympy.Basic] = []  # a later branch runs where every earlier condition is false
        for value, cond in e.args:
            known = dict(facts)
            for c, holds in [*((c, False) for c in earlier), (cond, True)]:
                for sub, (lo, hi) in _facts(c, holds):
                    old = known.get(sub, (-sympy.oo, sympy.oo))
                    known[sub] = (_max(old[0], lo), _min(old[1], hi))
            lo, hi = self.of(value, known)
            los.append(lo)
            his.append(hi)
            earlier.append(cond)
        return _min(*los), _max(*his)


def _facts(cond: sympy.Basic, holds: bool) -> list[tuple[sympy.Expr, Interval]]:
    """What a condition (true when `holds`, else false) says about the integer subexpressions it compares with a
    number: `n < 8` false gives n in [8, oo)."""
    oo = sympy.oo
    if isinstance(cond, sympy.Not):
        return _facts(cond.args[0], not holds)
    if isinstance(cond, sympy.And if holds else sympy.Or):
        return [f for c in cond.args for f in _facts(c, holds)]
    if not isinstance(cond, sympy.Lt | sympy.Le | sympy.Gt | sympy.Ge):
        return []
    lhs, rhs, op = cond.lhs, cond.rhs, type(cond)
    if lhs.is_number and not rhs.is_number:  # c < x is x > c
        lhs, rhs = rhs, lhs
        op = {sympy.Lt: sympy.Gt, sympy.Le: sympy.Ge, sympy.Gt: sympy.Lt, sympy.Ge: sympy.Le}[op]
    if not rhs.is_number or lhs.is_number or lhs.is_integer is not True:
        return []
    if not holds:
        op = {sympy.Lt: sympy.Ge, sympy.Le: sympy.Gt, sympy.Gt: sympy.Le, sympy.Ge: sympy.Lt}[op]
    c = sympy.Integer(sympy.floor(rhs)) if op in (sympy.Lt, sympy.Le) else sympy.Integer(sympy.ceiling(rhs))
    if op is sympy.Lt:
        return [(lhs, (-oo, c - 1 if c == rhs else c))]
    if op is sympy.Le:
        return [(lhs, (-oo, c))]
    if op is sympy.Gt:
        return [(lhs, (c + 1 if c == rhs else c, oo))]
    return [(lhs, (c, oo))]


def _min(*values: sympy.Expr) -> sympy.Expr:
    return sympy.Min(*values)


def _max(*values: sympy.Expr) -> sympy.Expr:
    return sympy.Max(*values)


def _times(a: Interval, b: Interval) -> Interval:
    for x, y in (a, b), (b, a):
        if x[0] == x[1] and x[0].is_number:  # a constant factor
            c = x[0]
            return (c * y[0], c * y[1]) if c >= 0 else (c * y[1], c * y[0])
    if any(not v.is_finite for v in (*a, *b)):
        return -sympy.oo, sympy.oo
    products = [p * q for p in a for q in b]
    return _min(*products), _max(*products)


def _power(base: Interval, n: int) -> Interval:
    lo, hi = base
    if n == 0:
        return sympy.Integer(1), sympy.Integer(1)
    if n > 0 and (n % 2 or _provably(lo >= 0)):
        return lo**n, hi**n
    if n > 0:
        return sympy.Integer(0), _max(lo**n, hi**n)
    if _provably(lo > 0):
        return hi**n, lo**n
    return -sympy.oo, sympy.oo


def _provably(relation: sympy.Basic) -> bool:
    """Whether `a >= b` (or >, <, <=) holds for every admissible size, deciding through Min/Max: the difference
    is rewritten with sums and negations pushed inside Min and Max, whose signs sympy then knows."""
    if relation in (sympy.true, sympy.false):
        return bool(relation)
    if not isinstance(relation, sympy.Ge | sympy.Gt | sympy.Le | sympy.Lt):
        return False
    difference = relation.lhs - relation.rhs if isinstance(relation, sympy.Ge | sympy.Gt) else \
        relation.rhs - relation.lhs
    if difference.has(sympy.nan, sympy.zoo):
        return False
    try:
        form = _pushed(sympy.expand(difference) if not difference.has(sympy.oo, -sympy.oo) else difference)
        strict = isinstance(relation, sympy.Gt | sympy.Lt)
        return bool(form.is_positive if strict else form.is_nonnegative)
    except TypeError:  # a comparison sympy cannot make: not proven
        return False


def _pushed(e: sympy.Expr) -> sympy.Expr:
    """`e` with additions and constant factors moved inside Min/Max (c + min(a, b) = min(c + a, c + b),
    -min(a, b) = max(-a, -b)), so that sympy's sign rules for Min and Max see whole comparisons."""
    if isinstance(e, sympy.Min | sympy.Max):
        return type(e)(*[_pushed(a) for a in e.args])
    if isinstance(e, sympy.Add):
        terms = [_pushed(a) for a in e.args]
        inner = next((t for t in terms if isinstance(t, sympy.Min | sympy.Max)), None)
        if inner is None:
            return sympy.Add(*terms)
        rest = sympy.Add(*[t for t in terms if t is not inner])
        return type(inner)(*[_pushed(a + rest) for a in inner.args])
    if isinstance(e, sympy.Mul):
        factors = [_pushed(a) for a in e.args]
        inner = next((f for f in factors if isinstance(f, sympy.Min | sympy.Max)), None)
        rest = sympy.Mul(*[f for f in factors if f is not inner])
        if inner is not None and rest.is_number and rest.is_finite:
            flip = {sympy.Min: sympy.Max, sympy.Max: sympy.Min}[type(inner)] if rest < 0 else type(inner)
            return flip(*[_pushed(rest * a) for a in inner.args])
        return sympy.Mul(*factors)
    return e


def _readable(value: sympy.Expr) -> str:
    """A bound as messages print it: call-time sizes as size(AXIS), positions by their axis name."""
    sizes = {s: sympy.Symbol(f"size({s.name})") for s in value.free_symbols
             if isinstance(s, sympy.Symbol) and not isinstance(s, Position) and s.is_positive}
    return sympy.sstr(value.subs(sizes))


# --- which loads gather, and the axes they carry ------------------------------------------------------------------


def positions(index: sympy.Expr) -> set[str]:
    return {s.name for s in index.free_symbols if isinstance(s, Position)}


def load_axes(index: Sequence[ir.LoadIndex], axis_order: Sequence[str]) -> tuple[str, ...]:
    """The wires a load carries: its relabelled axes in index order, then the positions its index expressions read,
    in the spec's axis order."""
    plain = [i.axis for i in index if i.axis is not None]
    read = set().union(*(positions(i.index) for i in index if i.index is not None))
    return (*plain, *(a for a in axis_order if a in read and a not in plain))


def is_gather(program: ir.Program, node: ir.Load) -> bool:
    """Whether a load reads at an index expression of anything besides finite-sum indices (positions, scalar
    inputs, call-time sizes): then it is a gather, not a select."""
    scalars = {t.name for t in program.inputs if not t.axes}
    return any(i.index is not None and any(isinstance(s, Position) or s.name in scalars or s.is_positive
                                           for s in i.index.free_symbols) for i in node.index)


# --- evaluation: one walk, two back ends (tensors for the reference, code for the generic family) -----------------


class _Ops(Protocol):
    """The operations an index is computed with; values are float64 tensors (or Python numbers): `_TensorOps`
    evaluates them, `_CodeOps` writes them as torch code."""

    def number(self, value: float) -> Any: ...

    def tensor(self, value: Any) -> Any: ...

    def call(self, fn: str, *args: Any) -> Any: ...

    def keyword(self, name: str, value: Any) -> Any: ...

    def infix(self, op: str, a: Any, b: Any) -> Any: ...


_CALLS = {"Min": "torch.minimum", "Max": "torch.maximum", "floor": "torch.floor", "ceiling": "torch.ceil",
          "Abs": "torch.abs", "log": "torch.log", "And": "torch.logical_and", "Or": "torch.logical_or",
          "Not": "torch.logical_not"}
LOG_SLACK = 1e-10  # float64 logs are good to a few 1e-16; an index within this of an integer rounds to it
_INFIX = {sympy.Lt: "<", sympy.Le: "<=", sympy.Gt: ">", sympy.Ge: ">=", sympy.Eq: "==", sympy.Ne: "!="}


def _walk(e: sympy.Basic, leaf: Callable[[sympy.Symbol], Any], ops: _Ops) -> Any:
    if isinstance(e, BooleanTrue | BooleanFalse):
        raise ValueError("a condition that is always true or false")
    if isinstance(e, sympy.Expr) and e.is_number:
        if not e.is_finite:
            raise ValueError(f"the number {e}")
        return ops.number(float(e))
    if isinstance(e, sympy.Symbol):
        return leaf(e)
    if isinstance(e, sympy.Piecewise):  # from where(COND, A, B): the last condition is always true
        (value, cond), rest = e.args[0], e.args[1:]
        if cond is sympy.true or not rest:
            return _walk(value, leaf, ops)
        otherwise = _walk(sympy.Piecewise(*rest), leaf, ops)
        return ops.call("torch.where", ops.tensor(_walk(cond, leaf, ops)), ops.tensor(_walk(value, leaf, ops)),
                        ops.tensor(otherwise))
    if isinstance(e, sympy.Pow) and e.exp.is_Integer:
        n = int(e.exp)
        base = _walk(e.base, leaf, ops)
        out = base
        for _ in range(abs(n) - 1):
            out = ops.infix("*", out, base)
        return out if n > 0 else ops.infix("/", ops.number(1.0), out)
    if isinstance(e, sympy.Mul) and isinstance(e.args[0], sympy.Rational) and e.args[0].q != 1:
        # k / 3 as a division, never k * 0.333..: IEEE division rounds an exact quotient to itself, so a floor of
        # a division of integers is exact (a rounded reciprocal can put 3 m / 3 an ulp below m)
        numerator = _walk(e.func(e.args[0].p, *e.args[1:]), leaf, ops)
        return ops.infix("/", numerator, ops.number(float(e.args[0].q)))
    args = [_walk(a, leaf, ops) for a in e.args]
    if isinstance(e, sympy.Add | sympy.Mul):
        out = args[0]
        for a in args[1:]:
            out = ops.infix("+" if isinstance(e, sympy.Add) else "*", out, a)
        return out
    if type(e) in _INFIX:
        return ops.infix(_INFIX[type(e)], ops.tensor(args[0]), args[1])
    name = type(e).__name__
    if name in ("Min", "Max"):  # sympy puts a number first: min(16, x) is clamp(x, max=16)
        numbers = [a for a, arg in zip(args, e.args, strict=True) if arg.is_number]
        values = [a for a, arg in zip(args, e.args, strict=True) if not arg.is_number]
        out = ops.tensor(values[0])
        for a in values[1:]:
            out = ops.call(_CALLS[name], out, ops.tensor(a))
        for a in numbers:
            out = ops.call("torch.clamp", out, ops.keyword("max" if name == "Min" else "min", a))
        return out
    if name in ("floor", "ceiling") and e.args[0].has(sympy.log):
        # a log is rounded: 8 log(64 / 8) / log(16) is 5.999999999999999 in float64, not 6; a value within LOG_SLACK
        # (relative) of an integer is taken as that integer, the value the formula has exactly
        x = ops.tensor(args[0])
        slack = ops.infix("*", ops.number(LOG_SLACK), ops.infix("+", ops.number(1.0), ops.call("torch.abs", x)))
        nudged = ops.infix("+", x, slack) if name == "floor" else ops.infix("-", x, slack)
        return ops.call(_CALLS[name], nudged)
    if name in ("floor", "ceiling"):  # one division by the common denominator: (3 k + 1) / 49, exact
        return ops.call(_CALLS[name], ops.tensor(_walk(sympy.together(e.args[0]), leaf, ops)))
    if name in _CALLS:
        out = ops.tensor(args[0])
        if name in ("And", "Or"):
            for a in args[1:]:
                out = ops.call(_CALLS[name], out, ops.tensor(a))
            return out
        return ops.call(_CALLS[name], out)
    raise ValueError(f"no evaluation of {name} in an index")


class _TensorOps:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def number(self, value: float) -> Any:
        return value

    def tensor(self, value: Any) -> Any:
        return value if isinstance(value, torch.Tensor) else torch.tensor(value, dtype=torch.float64,
                                                                          device=self.device)

    def call(self, fn: str, *args: Any) -> Any:
        keywords: dict[str, Any] = dict(a for a in args if isinstance(a, tuple))
        return getattr(torch, fn.partition(".")[2])(*(a for a in args if not isinstance(a, tuple)), **keywords)

    def keyword(self, name: str, value: Any) -> Any:
        return (name, value)

    def infix(self, op: str, a: Any, b: Any) -> Any:
        return {"+": lambda: a + b, "-": lambda: a - b, "*": lambda: a * b, "/": lambda: a / b, "<": lambda: a < b,
                "<=": lambda: a <= b, ">": lambda: a > b, ">=": lambda: a >= b, "==": lambda: a == b,
                "!=": lambda: a != b}[op]()


class _CodeOps:
    def number(self, value: float) -> Any:
        return repr(value) if value >= 0 or value != value else f"({value!r})"

    def tensor(self, value: Any) -> Any:
        return value if not _is_number_code(value) else \
            f"torch.tensor({value}, dtype=torch.float64, device=_device)"

    def call(self, fn: str, *args: Any) -> Any:
        return f"{fn}({', '.join(args)})"

    def keyword(self, name: str, value: Any) -> Any:
        return f"{name}={value}"

    def infix(self, op: str, a: Any, b: Any) -> Any:
        return f"({a} {op} {b})"


def torch_code(expr: sympy.Expr, name: str) -> str:
    """PyTorch code of an index expression of one variable, printed as `name` (a float64 tensor; `_device` names
    the device of the constants), by the walk the reference evaluates: the same operations, the same rounding.
    ValueError for an expression the walk has no operation for."""
    ops = _CodeOps()
    return ops.tensor(_walk(expr, lambda s: name, ops))


def _is_number_code(code: str) -> bool:
    try:
        float(code.strip("()"))
    except ValueError:
        return code.strip("()") == "nan"
    return True


def _shape(axes: Sequence[str], axis: str) -> list[int]:
    return [-1 if a == axis else 1 for a in axes]


def gather(program: ir.Program, node: ir.Load, data: torch.Tensor, sizes: Mapping[str, int],
           scope: Mapping[str, object], scalars: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The reference's value of a gathering load: `data` (the tensor) read at every position of `node.axes`. An
    index outside its axis (which the compiler rules out) raises, naming the tensor, the axis and the position."""
    ops = _TensorOps(data.device)
    axes = node.axes
    tensor = program.tensor(node.tensor)

    def leaf(s: sympy.Symbol) -> Any:
        if isinstance(s, Position):
            return torch.arange(sizes[s.name], dtype=torch.float64).view(_shape(axes, s.name))
        if s.name in scope:
            return float(scope[s.name])  # type: ignore[arg-type]
        if s.name in scalars:
            return scalars[s.name].to(torch.int64).to(torch.float64).reshape(())  # an i32 input holds an integer
        return float(sizes[s.name])  # a call-time size

    picks = []
    for dim, (index, axis) in enumerate(zip(node.index, tensor.axes, strict=True)):
        if index.axis is not None:
            picks.append(torch.arange(sizes[index.axis]).view(_shape(axes, index.axis)))
            continue
        assert index.index is not None
        value = ops.tensor(_walk(index.index, leaf, ops))
        bad = ~torch.isfinite(value) | (value < 0) | (value > data.shape[dim] - 1)
        if bool(bad.any()):
            where = [int(i) for i in bad.nonzero()[0]] if bad.dim() else []
            at = ", ".join(f"{a}={where[k]}" for k, a in enumerate(axes) if where and bad.shape[k] > 1)
            found = float(value[tuple(where)] if where else value)
            raise IndexError(f"{node.tensor}: index {index.index} of axis '{axis}' (size {data.shape[dim]}) is "
                             f"{int(found) if found.is_integer() else found} at {at or 'every position'}: outside "
                             "the axis")
        picks.append(value.to(torch.int64))
    shape = [sizes[a] for a in axes]
    return data[tuple(picks)].expand(shape) if axes else data[tuple(picks)]


def emit_gather(emitter: Any, node: ir.Load, scope: Mapping[str, object]) -> Any:
    """The generic family's code for a gathering load (`ncd.families.generic.emit.BodyEmitter.load`): the same
    float64 walk as `gather`, printed, then one advanced-indexing read of the tensor (autograd's backward of it
    adds the gradient into the entries read, repeats summed)."""
    from .families.generic.emit import Value, unsupported

    ops = _CodeOps()
    axes = node.axes
    span = node.span
    if any(a in emitter.sliced for a in axes):
        raise unsupported(span, "an index expression inside a scan over an axis it reads",
                          "read the tensor outside the scan, in a definition of its own")

    def arange(axis: str, dtype: str) -> str:
        shape = ", ".join(map(str, _shape(axes, axis)))
        code = f"torch.arange({emitter.size(axis)}, dtype=torch.{dtype}, device=_device).view({shape})"
        return emitter.emit(code, (axis,), span).code

    def leaf(s: sympy.Symbol) -> str:
        if isinstance(s, Position):
            return arange(s.name, "float64")
        if s.name in scope:
            return repr(float(scope[s.name]))  # type: ignore[arg-type]
        if s.name in emitter.env:  # an integer scalar input
            value = f"torch.as_tensor({emitter.env[s.name].code}, device=_device).to(torch.int64).to(torch.float64)"
            return emitter.emit(value, (), span).code  # an i32 input holds an integer (a cast truncates)
        return f"float({emitter.full_size(s.name)})"

    picks = []
    for index in node.index:
        if index.axis is not None:
            picks.append(arange(index.axis, "int64"))
            continue
        assert index.index is not None
        try:
            code = ops.tensor(_walk(index.index, leaf, ops))
        except ValueError as err:
            raise unsupported(span, f"this index ({err})", "write it with + - * /, min, max, floor, abs, log, "
                              "where") from None
        picks.append(emitter.emit(f"{code}.to(torch.int64)", axes, span).code)
    source = emitter.env[node.tensor].code
    value = emitter.emit(f"{source}[{', '.join(picks)}]", axes, span)
    return value if value.axes == axes else Value(value.code, axes)
