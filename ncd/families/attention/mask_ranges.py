"""Exact intervals of an attention mask, for block skipping.

The attention kernels skip key blocks that a mask leaves empty and run unmasked code on blocks it leaves full. Both
need, for each query row i, the visible keys as ONE interval [lower(i), upper(i)] (and for the backward pass the
queries that see each key j). This module derives that interval from the mask's sympy form, or says it cannot.

Exactness is the contract: a block inside [max lower, min upper] over its rows runs WITHOUT the mask, so an interval
that is too wide anywhere silently corrupts results. Every rule below is therefore an equivalence, never an
approximation; whatever no rule proves exact gives None (mask every block, skip none), which is always safe.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy
from sympy.core.relational import Relational

_BELOW = (sympy.Le, sympy.Lt)  # `side <(=) other`: the side is bounded above
_ABOVE = (sympy.Ge, sympy.Gt)
_FLIPPED = {sympy.Le: sympy.Ge, sympy.Lt: sympy.Gt, sympy.Ge: sympy.Le, sympy.Gt: sympy.Lt, sympy.Eq: sympy.Eq}


@dataclass(frozen=True)
class Interval:
    """{col : cond(row, col)} == {col : lower <= col <= upper} when `gate` holds, else empty, for every value of row
    and of the other symbols. lower/upper: sympy expressions (integer-valued) in row and the other symbols, or None
    for unbounded (the kernel clips to [0, N)). gate: a sympy boolean free of `col` (sympy.true when always)."""

    lower: sympy.Expr | None
    upper: sympy.Expr | None
    gate: sympy.Basic


def visible_interval(cond: sympy.Basic, row: sympy.Symbol, col: sympy.Symbol,
                     col_dependent: frozenset[sympy.Symbol] = frozenset()) -> Interval | None:
    """The interval of `col` that `cond` leaves visible for each `row`, or None when the visible set is not provably
    one interval (then the kernels mask every block and skip none). `col_dependent`: symbols that stand for values
    that vary with col (a per-key tensor such as k_doc_j): a comparison that reads one of them is not an interval
    in col, so such a cond gives None unless that comparison can be dropped exactly (it cannot, in general).

    `col` must be declared integer (the rounding rules need it); the other symbols must be real (declare integer
    scalars integer=True too, else their bounds keep a floor/ceiling). When col is also declared nonnegative, `g or I`
    (g free of col, I bounded below only, as in prefix-LM's backward) is encoded with a Piecewise lower bound."""
    if row == col:
        raise ValueError(f"row and col are the same symbol {col}")
    if col.is_integer is not True:
        raise ValueError(f"col symbol {col} must be declared integer=True: the rounding of its bounds assumes it")
    # The spec's condition arrives unevaluated (`key <= key` stays a relational); evaluating it bottom-up first
    # folds `0*j` and the like, which sympy's assumption system otherwise trips over (InconsistentAssumptions).
    return _interval(cond.doit(), col, frozenset(col_dependent))


def _interval(cond: sympy.Basic, col: sympy.Symbol, dependent: frozenset[sympy.Symbol]) -> Interval | None:
    if not cond.free_symbols & (dependent | {col}):  # true, false, or a condition on row and scalars only
        return Interval(None, None, cond)
    if isinstance(cond, sympy.Not):
        negated = _negate(cond.args[0])
        return None if isinstance(negated, sympy.Not) else _interval(negated, col, dependent)
    if isinstance(cond, (sympy.And, sympy.Or)):
        is_and = isinstance(cond, sympy.And)
        combined: Interval | None = Interval(None, None, sympy.true if is_and else sympy.false)  # the identity
        for arg in cond.args:
            part = _interval(arg, col, dependent)
            if part is None or combined is None:
                return None
            combined = _intersect(combined, part) if is_and else _union(combined, part, col)
        return combined
    if isinstance(cond, Relational):
        if cond.free_symbols & dependent:  # compares a value that varies with col: not an interval in col
            return None
        split = _split_extremum(cond)
        return _interval(split, col, dependent) if split is not None else _relational(cond, col)
    return None  # Xor, Implies, ...: not worth proving anything about


def _negate(cond: sympy.Basic) -> sympy.Basic:
    """De Morgan down to the relationals, which negate exactly (not a <= b is a > b; not a == b is a != b)."""
    if isinstance(cond, sympy.And):
        return sympy.Or(*map(_negate, cond.args))
    if isinstance(cond, sympy.Or):
        return sympy.And(*map(_negate, cond.args))
    if isinstance(cond, sympy.Not):
        return cond.args[0]
    if isinstance(cond, Relational):
        return cond.negated
    return sympy.Not(cond)


def _split_extremum(rel: Relational) -> sympy.Basic | None:
    """`Max(a, b) <= c` is `a <= c and b <= c`, `Min(a, b) <= c` is `a <= c or b <= c`; `Abs(u)` is `Max(u, -u)`.
    Rewrites a side that is one of these (abs(j - i) <= w gives the bidirectional window), else None."""
    for form in (rel, rel.reversed):
        side = form.lhs
        args = (side.args[0], -side.args[0]) if isinstance(side, sympy.Abs) else side.args
        if isinstance(side, (sympy.Abs, sympy.Max, sympy.Min)) and isinstance(form, _BELOW + _ABOVE):
            parts = [type(form)(arg, form.rhs) for arg in args]
            every = isinstance(form, _BELOW) == isinstance(side, (sympy.Abs, sympy.Max))
            return sympy.And(*parts) if every else sympy.Or(*parts)
    return None


def _relational(rel: Relational, col: sympy.Symbol) -> Interval | None:
    """`a*col + rest OP 0` with a rational a != 0 is `col OP' bound`, bound = -rest/a. col is an integer, so
    col <= e iff col <= floor(e), col < e iff col <= ceiling(e) - 1, col >= e iff col >= ceiling(e), col > e iff
    col >= floor(e) + 1, col == e iff ceiling(e) <= col <= floor(e) (empty when e is not an integer). sympy drops
    floor/ceiling of integer-valued e by itself, so integer masks get plain bounds."""
    if not (isinstance(rel.lhs, sympy.Expr) and isinstance(rel.rhs, sympy.Expr)):
        return None
    difference = sympy.expand(rel.lhs - rel.rhs)
    coefficient = difference.coeff(col)
    rest = sympy.expand(difference - coefficient * col)
    if col in rest.free_symbols or not coefficient.is_Rational:
        return None  # col inside a function, a product with a symbol, or a non-rational coefficient
    if coefficient == 0:  # col cancels (`j - j < q`): a condition on the other symbols
        return Interval(None, None, type(rel)(rest, 0))
    bound = -rest / coefficient
    op = _FLIPPED.get(type(rel)) if coefficient < 0 else type(rel)
    if op is sympy.Le:
        return Interval(None, sympy.floor(bound), sympy.true)
    if op is sympy.Lt:
        return Interval(None, sympy.ceiling(bound) - 1, sympy.true)
    if op is sympy.Ge:
        return Interval(sympy.ceiling(bound), None, sympy.true)
    if op is sympy.Gt:
        return Interval(sympy.floor(bound) + 1, None, sympy.true)
    if op is sympy.Eq:
        return Interval(sympy.ceiling(bound), sympy.floor(bound), sympy.true)
    return None  # Ne: the visible set is two intervals


def _extreme(pick: type, a: sympy.Expr | None, b: sympy.Expr | None) -> sympy.Expr | None:
    """Max/Min of two bounds where None (unbounded) is the neutral element."""
    return b if a is None else a if b is None else pick(a, b)


def _intersect(a: Interval, b: Interval) -> Interval:
    return Interval(_extreme(sympy.Max, a.lower, b.lower), _extreme(sympy.Min, a.upper, b.upper),
                    sympy.And(a.gate, b.gate))


def _union(a: Interval, b: Interval, col: sympy.Symbol) -> Interval | None:
    """The union is one interval only when provable: intervals with the same start (or end) and gate are nested, so
    [l, u1] | [l, u2] = [l, max(u1, u2)] even when one is empty. A col-free side g (all cols when g) joins an
    interval bounded below only as lower = 0 if g, when col is declared nonnegative. Anything else: None."""
    if a.gate is sympy.false or b.gate is sympy.false:
        return b if a.gate is sympy.false else a
    if a.gate == b.gate and a.lower == b.lower:
        return Interval(a.lower, None if None in (a.upper, b.upper) else sympy.Max(a.upper, b.upper), a.gate)
    if a.gate == b.gate and a.upper == b.upper:
        return Interval(None if None in (a.lower, b.lower) else sympy.Min(a.lower, b.lower), a.upper, a.gate)
    for everything, other in ((a, b), (b, a)):
        if everything.lower is None and everything.upper is None and other.upper is None:
            if other.lower is None:  # both are all-or-nothing
                return Interval(None, None, sympy.Or(a.gate, b.gate))
            if col.is_nonnegative:
                lower = sympy.Piecewise((0, everything.gate), (other.lower, True))
                return Interval(lower, None, sympy.Or(a.gate, b.gate))
    return None


def describe(interval: Interval | None, col: str = "col") -> str:
    """One line for `--emit plan`, e.g. "keys j in [i - window + 1, i]; gate: i < q_len"."""
    if interval is None:
        return f"{col}: not provably one interval (every block masked, none skipped)"
    if interval.gate is sympy.false:
        return f"{col}: none visible (the mask is always false)"
    if interval.lower is None and interval.upper is None:
        text = f"{col}: all"
    else:
        lower = "-inf" if interval.lower is None else sympy.sstr(interval.lower)
        upper = "+inf" if interval.upper is None else sympy.sstr(interval.upper)
        text = f"{col} in [{lower}, {upper}]"
    return text if interval.gate is sympy.true else f"{text}; gate: {sympy.sstr(interval.gate)}"
