"""Mask intervals (ncd/families/attention/mask_ranges.py) checked for EXACTNESS by brute force: for every row and col
of a small grid and every value of the other symbols, `cond` must hold exactly when the gate holds and col lies in
[lower, upper]. The kernels run blocks inside the interval without the mask, so one col too many is a wrong result.
Expressions are evaluated with Python ints and Fractions through a tiny printer of our own, not through sympy's
substitution, so the check does not share machinery with the code under test."""

from __future__ import annotations

import functools
import itertools
import math
import random
from collections.abc import Callable, Iterable
from fractions import Fraction
from typing import Any

import pytest
import sympy

from ncd.families.attention.mask_ranges import Interval, describe, visible_interval

i, j = sympy.symbols("i j", integer=True)
w, p, kv_len, q_len = sympy.symbols("window prefix kv_len q_len", integer=True)
fw = sympy.Symbol("fwindow", positive=True)  # a float scalar input
q_doc, k_doc, q_start = sympy.symbols("q_doc_i k_doc_j q_start_i", integer=True)
ni, nj = sympy.symbols("i j", integer=True, nonnegative=True)

GRID = range(-2, 12)  # rows and cols, a little beyond [0, N) too: the interval claims every integer
POSITIONS = range(12)  # for per-position tensors and nonnegative symbols
DOC_SEQUENCES = [(0,) * 12, (0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 4, 4), (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11),
                 (0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1)]
Env = Callable[[int, int], dict[str, Any]]  # (i, j) -> the value of every symbol

_RELATIONS = {sympy.Le: "<=", sympy.Lt: "<", sympy.Ge: ">=", sympy.Gt: ">", sympy.Eq: "==", sympy.Ne: "!="}
_CALLS = {sympy.floor: "math.floor", sympy.ceiling: "math.ceil", sympy.Max: "max", sympy.Min: "min", sympy.Abs: "abs"}


def _source(expr: sympy.Basic) -> str:
    """Python source of a sympy expression or boolean, exact over ints and Fractions."""
    if expr is sympy.true or expr is sympy.false:
        return str(bool(expr))
    if isinstance(expr, sympy.Symbol):
        return f"env[{expr.name!r}]"
    if isinstance(expr, sympy.Integer):
        return str(int(expr))
    if isinstance(expr, sympy.Rational):
        return f"Fraction({expr.p}, {expr.q})"
    if isinstance(expr, sympy.Add):
        return "(" + " + ".join(map(_source, expr.args)) + ")"
    if isinstance(expr, sympy.Mul):
        return "(" + " * ".join(map(_source, expr.args)) + ")"
    if isinstance(expr, sympy.Pow) and expr.exp.is_Integer:
        return f"(Fraction({_source(expr.base)}) ** {int(expr.exp)})"
    if type(expr) in _RELATIONS:
        return f"({_source(expr.lhs)} {_RELATIONS[type(expr)]} {_source(expr.rhs)})"
    if isinstance(expr, (sympy.And, sympy.Or)):
        return "(" + (" and " if isinstance(expr, sympy.And) else " or ").join(map(_source, expr.args)) + ")"
    if isinstance(expr, sympy.Not):
        return f"(not {_source(expr.args[0])})"
    if isinstance(expr, sympy.Piecewise):
        (value, condition), *rest = expr.args
        return _source(value) if condition is sympy.true else \
            f"({_source(value)} if {_source(condition)} else {_source(sympy.Piecewise(*rest))})"
    if expr.func in _CALLS:
        return f"{_CALLS[expr.func]}({', '.join(map(_source, expr.args))})"
    raise TypeError(f"the exact evaluator has no rule for {expr!r}: add one beside the others")


def _compile(expr: sympy.Basic) -> Callable[[dict[str, Any]], Any]:
    return eval(f"lambda env: {_source(expr)}", {"Fraction": Fraction, "math": math})


def scalar_envs(**values: Iterable[Any]) -> list[Env]:
    """Every combination of the given scalar values, with i and j filled in per grid point."""
    names = list(values)
    def env(a: int, b: int, combo: tuple) -> dict[str, Any]:
        return {"i": a, "j": b, **dict(zip(names, combo, strict=True))}
    return [functools.partial(env, combo=combo) for combo in itertools.product(*values.values())]


def doc_envs() -> list[Env]:
    """Per-token document ids of sorted sequences: q_doc_i, k_doc_j, and q_start_i (first token of i's document)."""
    def env(a: int, b: int, docs: tuple[int, ...]) -> dict[str, Any]:
        return {"i": a, "j": b, "q_doc_i": docs[a], "k_doc_j": docs[b], "q_start_i": docs.index(docs[a])}
    return [functools.partial(env, docs=docs) for docs in DOC_SEQUENCES]


def assert_exact(cond: sympy.Basic, row: sympy.Symbol, col: sympy.Symbol, interval: Interval | None,
                 envs: list[Env], grid: Iterable[int] = GRID, col_dependent: Iterable[sympy.Symbol] = ()) -> None:
    """The interval (evaluated once per row: it must not read col) reproduces `cond` at every grid point."""
    assert interval is not None, cond
    bounds = [b for b in (interval.lower, interval.upper, interval.gate) if b is not None]
    for bound in bounds:
        assert not bound.free_symbols & {col, *col_dependent}, (bound, "reads col")
    test = _compile(cond)
    lower, upper, gate = (None if b is None else _compile(b) for b in (interval.lower, interval.upper, interval.gate))
    grid = list(grid)
    for env in envs:
        for r in grid:
            def at(c: int, r: int = r, env: Env = env) -> dict[str, Any]:
                return env(r, c) if row.name == "i" else env(c, r)
            first = at(grid[0])
            low = None if lower is None else lower(first)
            high = None if upper is None else upper(first)
            gated = gate(first) if gate is not None else True
            for c in grid:
                expected = bool(test(at(c)))
                got = bool(gated) and (low is None or low <= c) and (high is None or c <= high)
                assert expected == got, (cond, row, col, interval, at(c))


def check_both(cond: sympy.Basic, envs: list[Env], grid: Iterable[int] = GRID, rows=(i, j)) -> tuple:
    """Keys per query and queries per key, each exact; returns both intervals."""
    a, b = rows
    forward, backward = visible_interval(cond, a, b), visible_interval(cond, b, a)
    assert_exact(cond, a, b, forward, envs, grid)
    assert_exact(cond, b, a, backward, envs, grid)
    return forward, backward


WINDOWS = scalar_envs(window=range(1, 5))


def test_causal():
    forward, backward = check_both(j <= i, scalar_envs())
    assert forward == Interval(None, i, sympy.true) and backward == Interval(j, None, sympy.true)


def test_strict_causal_and_negated_causal():
    forward, _ = check_both(j < i, scalar_envs())
    assert forward == Interval(None, i - 1, sympy.true)
    negated, _ = check_both(sympy.Not(j > i), scalar_envs())
    assert negated == Interval(None, i, sympy.true)


def test_sliding_window_causal():
    forward, backward = check_both(sympy.And(j <= i, j > i - w), WINDOWS)
    assert forward == Interval(i - w + 1, i, sympy.true) and backward == Interval(j, j + w - 1, sympy.true)


@pytest.mark.parametrize("cond", [sympy.And(j - i <= w, i - j <= w), sympy.Abs(j - i) <= w, sympy.Abs(i - j) <= w,
                                  sympy.Max(j - i, i - j) <= w, sympy.Not(sympy.Abs(j - i) > w)])
def test_bidirectional_window(cond):
    forward, backward = check_both(cond, WINDOWS)
    assert forward == Interval(i - w, i + w, sympy.true) and backward == Interval(j - w, j + w, sympy.true)


def test_float_window():
    envs = scalar_envs(fwindow=[Fraction(1, 2), Fraction(3, 2), 2, Fraction(5, 2), Fraction(7, 3), 4])
    forward, _ = check_both(sympy.And(j <= i, j > i - fw), envs)
    assert forward is not None and forward.lower.has(sympy.floor)
    check_both(sympy.Abs(j - i) < fw, envs)
    check_both(sympy.Eq(j, i - fw), envs)  # empty unless fwindow is an integer


def test_prefix_lm():
    cond = sympy.Or(j <= i, j < p)
    forward = visible_interval(cond, i, j)
    assert forward == Interval(None, sympy.Max(i, p - 1), sympy.true)
    assert_exact(cond, i, j, forward, scalar_envs(prefix=range(13)))
    # Queries per key: all queries when j < prefix, else i >= j. Not one expression over every integer i...
    assert visible_interval(cond, j, i) is None
    # ... but over nonnegative positions it is: lower = 0 when j < prefix.
    cond = sympy.Or(nj <= ni, nj < p)
    backward = visible_interval(cond, nj, ni)
    assert backward is not None and backward.lower.has(sympy.Piecewise)
    assert_exact(cond, nj, ni, backward, scalar_envs(prefix=range(13)), POSITIONS)


@pytest.mark.parametrize("cond", [sympy.Or(nj < p, sympy.And(ni >= nj, nj < kv_len)),
                                  sympy.Or(sympy.And(nj < p, nj < kv_len), sympy.And(2 * ni >= nj + p, ni + 1 > nj)),
                                  sympy.Or(nj < p, nj < kv_len, ni > nj + 2)])
def test_gate_or_lower_bounded_over_nonnegative_positions(cond):
    """`g or i >= L(j)`: every query when g, else [L, +inf); exact as lower = Piecewise((0, g), (L, True))."""
    backward = visible_interval(cond, nj, ni)
    assert backward is not None and backward.lower.has(sympy.Piecewise)
    assert_exact(cond, nj, ni, backward, scalar_envs(prefix=range(0, 13, 2), kv_len=range(0, 13, 3)), POSITIONS)


def test_paddings():
    envs = scalar_envs(kv_len=range(13), q_len=range(13))
    forward, backward = check_both(j < kv_len, envs)
    assert forward == Interval(None, kv_len - 1, sympy.true) and backward == Interval(None, None, j < kv_len)
    forward, backward = check_both(i < q_len, envs)
    assert forward == Interval(None, None, i < q_len) and backward == Interval(None, q_len - 1, sympy.true)
    forward, backward = check_both(sympy.And(j < kv_len, i < q_len, j <= i), envs)
    assert forward == Interval(None, sympy.Min(i, kv_len - 1), i < q_len)
    assert backward == Interval(j, q_len - 1, j < kv_len)


def test_padded_prefix_lm_shares_the_gate():
    cond = sympy.Or(sympy.And(j <= i, i < q_len), sympy.And(j < p, i < q_len))
    forward = visible_interval(cond, i, j)
    assert forward == Interval(None, sympy.Max(i, p - 1), i < q_len)
    assert_exact(cond, i, j, forward, scalar_envs(prefix=range(0, 13, 3), q_len=range(0, 13, 4)))


def test_non_unit_coefficients_round_exactly():
    envs = scalar_envs(window=range(1, 5))
    for cond in [2 * j <= i + 1, 3 * j > i - w, sympy.Eq(2 * j, i), sympy.And(-2 * j < -i, 3 * j <= 2 * i + w)]:
        check_both(cond, envs)


def test_document_start_per_query():
    """Document masking written with each query's document start is an interval of keys (not of queries)."""
    cond = sympy.And(j >= q_start, j <= i)
    forward = visible_interval(cond, i, j, frozenset({k_doc}))
    assert forward == Interval(q_start, i, sympy.true)
    assert_exact(cond, i, j, forward, doc_envs(), POSITIONS, col_dependent=[k_doc])
    assert visible_interval(cond, j, i, frozenset({q_doc, q_start})) is None


@pytest.mark.parametrize("cond, per_key, per_query", [
    (sympy.Ne(j, i), (), ()),
    (sympy.Eq(q_doc, k_doc), (k_doc,), (q_doc,)),
    (sympy.And(sympy.Eq(q_doc, k_doc), j <= i), (k_doc,), (q_doc,)),
    (sympy.And(j <= i + k_doc, i < q_doc + j), (k_doc,), (q_doc,)),  # a per-key value is no bound on keys
    (sympy.Or(j <= i, j > i + 5), (), ()),
    (sympy.Abs(j - i) > w, (), ()),
    (sympy.Or(j <= i, i < q_len), (), ()),  # all keys when i < q_len, else j <= i: unbounded above when gated
])
def test_not_one_interval(cond, per_key, per_query):
    assert visible_interval(cond, i, j, frozenset(per_key)) is None
    assert visible_interval(cond, j, i, frozenset(per_query)) is None


def test_unevaluated_conditions_as_the_spec_gives_them():
    """ncd.symbolic.condition_to_sympy keeps the spec's structure (evaluate=False); the result is the same."""
    window = sympy.And(sympy.Le(j, i, evaluate=False), sympy.Not(sympy.Le(j, i - w, evaluate=False), evaluate=False),
                       evaluate=False)
    forward, backward = check_both(window, WINDOWS)
    assert forward == Interval(i - w + 1, i, sympy.true) and backward == Interval(j, j + w - 1, sympy.true)
    assert visible_interval(sympy.Le(j, j, evaluate=False), i, j) == Interval(None, None, sympy.true)
    cancelled, _ = check_both(sympy.Lt(j + i, j + q_len, evaluate=False), scalar_envs(q_len=range(13)))
    assert cancelled == Interval(None, None, i - q_len < 0)


def test_constant_conditions_and_errors():
    assert visible_interval(sympy.true, i, j) == Interval(None, None, sympy.true)
    assert visible_interval(sympy.false, i, j) == Interval(None, None, sympy.false)
    with pytest.raises(ValueError, match="integer"):
        visible_interval(j <= i, i, sympy.Symbol("x"))
    with pytest.raises(ValueError, match="same symbol"):
        visible_interval(j <= i, i, i)


def test_describe():
    assert describe(visible_interval(sympy.And(j <= i, j > i - w), i, j), "keys j") == "keys j in [i - window + 1, i]"
    assert describe(visible_interval(i < q_len, i, j), "keys j") == "keys j: all; gate: i < q_len"
    assert describe(visible_interval(j < i, j, i), "queries i") == "queries i in [j + 1, +inf]"
    assert "not provably" in describe(visible_interval(sympy.Ne(j, i), i, j), "keys j")
    assert "none visible" in describe(visible_interval(sympy.false, i, j))


def _random_side(rng: random.Random, a: sympy.Symbol, b: sympy.Symbol) -> sympy.Expr:
    scalar = rng.choice([w, p, fw, sympy.Integer(0)])
    side = rng.choice([-2, -1, -1, 0, 1, 1, 1, 2]) * a + rng.choice([-1, 0, 1, 1]) * b + \
        rng.choice([-1, 0, 1]) * scalar + rng.randint(-3, 3)
    if rng.random() < 0.1:
        return sympy.Abs(side)
    if rng.random() < 0.1:
        return rng.choice([sympy.Max, sympy.Min])(side, rng.choice([a, b, p]))
    return side


def _random_mask(rng: random.Random, depth: int, a: sympy.Symbol, b: sympy.Symbol) -> sympy.Basic:
    if depth == 0 or rng.random() < 0.4:
        relation = rng.choice([sympy.Le, sympy.Lt, sympy.Ge, sympy.Gt, sympy.Le, sympy.Lt, sympy.Eq, sympy.Ne])
        return relation(_random_side(rng, a, b), _random_side(rng, a, b))
    kind = rng.choice([sympy.And, sympy.And, sympy.Or, sympy.Not])
    if kind is sympy.Not:
        return sympy.Not(_random_mask(rng, depth - 1, a, b))
    return kind(*(_random_mask(rng, depth - 1, a, b) for _ in range(2)))


def test_random_masks_are_exact_or_none():
    """A hundred and fifty masks from the grammar the rules cover: every interval returned is exact, in both directions;
    enough of them are intervals for the check to mean something."""
    rng = random.Random(0)
    found = refused = 0
    for case in range(150):
        nonnegative = case % 3 == 0
        a, b = (ni, nj) if nonnegative else (i, j)
        with sympy.evaluate(rng.random() < 0.5):  # unevaluated input too: `2*j - j <= i`, `Not(j > i)` as written
            cond = _random_mask(rng, 3, a, b)
        envs = [env for env in scalar_envs(window=[rng.randint(1, 4)], prefix=[rng.randint(0, 12)],
                                           fwindow=[rng.choice([Fraction(1, 2), Fraction(7, 3), 2])])]
        envs += scalar_envs(window=[rng.randint(1, 4)], prefix=[rng.randint(0, 12)], fwindow=[Fraction(5, 2)])
        grid = range(0, 10) if nonnegative else range(-2, 8)
        for row, col in ((a, b), (b, a)):
            interval = visible_interval(cond, row, col)
            if interval is None:
                refused += 1
                continue
            found += 1
            assert_exact(cond, row, col, interval, envs, grid)
    assert found > 80 and refused > 30, (found, refused)
