"""Polynomial bases from the recurrence a spec gives (`ir.Basis`): sympy forms, the derivative recurrence,
float64 evaluation, and lookup tables sized from an error budget.

Nothing here knows a basis by name. The recurrence `P[n+1] = step(u, n, P[n], P[n-1], ...)` is read from the IR;
its derivative recurrence is `P'[n+1] = d step/du + sum_j d step/dP[n-j] * P'[n-j]` (sympy). A table samples
P_0..P_{D-1} and their derivatives on a uniform grid in a variable t(u) and is read by linear interpolation.
Candidate variables are measured, not assumed: t = u, and t = acos(u) when the argument stays in [-1, 1]
(for Chebyshev-like bases a trigonometric polynomial in t, so the interpolation error no longer grows with
the steep ends of P_d near u = +-1). The smallest table meeting the budget wins.

Error measure (the "basis max relative error"): for each degree d, the largest |table(u) - P_d(u)| over u in
the domain, divided by max_u |P_d(u)|, with the table stored in fp32, t computed in fp32 and interpolated in
fp32, against P_d at the same fp32 u evaluated in float64; the maximum over d. Derivative tables likewise.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import sympy

from ncd import ir
from ncd.symbolic import to_sympy

U = sympy.Symbol("u", real=True)  # the basis argument, whatever the spec names it
N = sympy.Symbol("n", integer=True, nonnegative=True)  # the step variable
# Basis max relative error (values and derivatives, fp32) the tables are sized for. The requirement is 1e-4 for
# degrees up to 24; the default keeps a 4x margin so that the norm-wise errors of outputs and gradients (which
# weigh the steep ends of the basis more than the max-normalised measure does) stay well under validate's 1e-4.
ERROR_BUDGET = 2.5e-5
MAX_ENTRIES = 1 << 16  # per table; a candidate needing more is rejected
# Size cap on a table, entries x degrees (fp32 cells; the values and the derivatives are one table each): 2^20
# cells is 4 MiB a table, 8 MiB together, embedded in the generated module and read by every program. It also
# bounds the search (each measurement evaluates about 5 x entries x degrees points), so that a high degree
# cannot hang the compile: above the cap the plan uses the exact recurrence (`basis_eval=recurrence`): for
# Chebyshev at the default budget, 55 degrees (P_0..P_54) take 15,116 entries and 58 or more get the recurrence;
# degree 1000 compiled in 7 s (CPU, 2026-11-25) where the uncapped search ran for minutes.
MAX_TABLE_CELLS = 1 << 20


def _term(j: int) -> sympy.Symbol:
    return sympy.Symbol(f"P{j}", real=True)  # P[n - j]


def _dterm(j: int) -> sympy.Symbol:
    return sympy.Symbol(f"dP{j}", real=True)  # P'[n - j]


def _to_sympy(node: ir.Node, basis: ir.Basis, axes: Mapping[str, ir.Axis] | None = None) -> sympy.Expr:
    """A basis rule's body as sympy in U, N and the earlier terms (`size(axis)` from `axes`)."""
    step_var = sympy.Symbol(basis.step_var, integer=True)

    def leaf(n: ir.Node) -> sympy.Expr | None:
        if isinstance(n, ir.BasisTerm):
            return _term(n.back)
        if isinstance(n, ir.Var):
            if n.name == basis.param:
                return U
            if n.name == basis.step_var:
                return N
            raise ValueError(f"unknown variable {n.name!r} in basis {basis.name}")
        return None  # numbers and constants

    return to_sympy(node, axes, leaf=leaf, exponent=lambda e: e.subs(step_var, N))


@dataclass(frozen=True)
class Recurrence:
    """P_0..P_{k-1} (`initial`, in U) and P_{n+1} = `step` (in U, N, P0 = P[n], P1 = P[n-1], ...), with the
    derivative recurrence derived by sympy."""

    name: str
    initial: tuple[sympy.Expr, ...]
    step: sympy.Expr
    depth: int  # how many earlier terms the step reads
    dinitial: tuple[sympy.Expr, ...] = field(init=False)
    dstep: sympy.Expr = field(init=False)

    def __post_init__(self) -> None:
        dinitial = tuple(sympy.diff(p, U) for p in self.initial)
        dstep = sympy.diff(self.step, U) + sum(
            (sympy.diff(self.step, _term(j)) * _dterm(j) for j in range(self.depth)), sympy.Integer(0))
        object.__setattr__(self, "dinitial", dinitial)
        object.__setattr__(self, "dstep", sympy.expand(dstep) if dstep.is_polynomial() else dstep)

    @staticmethod
    def from_ir(basis: ir.Basis, axes: Mapping[str, ir.Axis] | None = None) -> Recurrence:
        step = _to_sympy(basis.step, basis, axes)
        depth = max((t.back for t in ir.walk(basis.step) if isinstance(t, ir.BasisTerm)), default=-1) + 1
        return Recurrence(basis.name, tuple(_to_sympy(t, basis, axes) for t in basis.initial), step, depth)

    def terms(self, count: int, prefix: str = "p") -> list[tuple[sympy.Expr, sympy.Expr]]:
        """(P_k, P'_k) for k < count as expressions in U and the earlier terms' symbols `p{j}`, `dp{j}`:
        what the kernels evaluate in recurrence mode (the step variable is a number at each k)."""
        out: list[tuple[sympy.Expr, sympy.Expr]] = []
        for k in range(count):
            if k < len(self.initial):
                out.append((self.initial[k], self.dinitial[k]))
                continue
            subs: dict[sympy.Basic, sympy.Basic] = {N: k - 1}
            for j in range(self.depth):
                subs[_term(j)] = sympy.Symbol(f"{prefix}{k - 1 - j}", real=True)
                subs[_dterm(j)] = sympy.Symbol(f"d{prefix}{k - 1 - j}", real=True)
            out.append((sympy.nsimplify(self.step.subs(subs)), sympy.nsimplify(self.dstep.subs(subs))))
        return out

    def describe(self) -> list[str]:
        step = sympy.sstr(self.step).replace("P0", "P[n]").replace("P1", "P[n-1]").replace("P2", "P[n-2]")
        dstep = sympy.sstr(self.dstep)
        for j in range(self.depth):
            dstep = dstep.replace(f"dP{j}", f"P'[n{'-' + str(j) if j else ''}]")
        for j in range(self.depth):
            dstep = dstep.replace(f"P{j}", f"P[n{'-' + str(j) if j else ''}]")
        return [*(f"P[{k}] = {sympy.sstr(p)}" for k, p in enumerate(self.initial)), f"P[n+1] = {step}",
                *(f"P'[{k}] = {sympy.sstr(p)}" for k, p in enumerate(self.dinitial)), f"P'[n+1] = {dstep}"]

    @functools.cached_property
    def _numeric(self) -> tuple[Callable[..., np.ndarray], Callable[..., np.ndarray]]:
        args = (U, N, *(_term(j) for j in range(self.depth)), *(_dterm(j) for j in range(self.depth)))
        return sympy.lambdify(args, self.step, "numpy"), sympy.lambdify(args, self.dstep, "numpy")

    def evaluate(self, u: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
        """P_k(u) and P'_k(u) for k < count, float64, shape [len(u), count]."""
        u = np.asarray(u, dtype=np.float64)
        values: list[np.ndarray] = []
        derivs: list[np.ndarray] = []
        for k in range(min(count, len(self.initial))):
            f = sympy.lambdify(U, self.initial[k], "numpy")
            df = sympy.lambdify(U, self.dinitial[k], "numpy")
            values.append(np.broadcast_to(np.asarray(f(u), dtype=np.float64), u.shape).copy())
            derivs.append(np.broadcast_to(np.asarray(df(u), dtype=np.float64), u.shape).copy())
        step, dstep = self._numeric
        while len(values) < count:
            n = len(values) - 1
            prev = [values[n - j] for j in range(self.depth)]
            dprev = [derivs[n - j] for j in range(self.depth)]
            values.append(np.broadcast_to(np.asarray(step(u, n, *prev, *dprev), dtype=np.float64), u.shape))
            derivs.append(np.broadcast_to(np.asarray(dstep(u, n, *prev, *dprev), dtype=np.float64), u.shape))
        return np.stack(values[:count], axis=-1), np.stack(derivs[:count], axis=-1)


@dataclass(frozen=True)
class Parameterisation:
    """The table's variable t(u), its inverse u(t), and the t interval covering the argument's range."""

    name: str
    forward: sympy.Expr  # t in U
    inverse: sympy.Expr  # u in T
    lo: float
    hi: float

    def to_u(self, t: np.ndarray) -> np.ndarray:
        return np.asarray(sympy.lambdify(T, self.inverse, "numpy")(t), dtype=np.float64) + 0 * t

    def to_t32(self, u32: np.ndarray) -> np.ndarray:
        """t(u) in fp32 arithmetic, as the kernels compute it."""
        return np.asarray(sympy.lambdify(U, self.forward, "numpy")(u32.astype(np.float32)),
                          dtype=np.float32) + np.float32(0) * u32.astype(np.float32)


T = sympy.Symbol("t", real=True)


def candidates(lo: float, hi: float) -> list[Parameterisation]:
    """t = u on [lo, hi]; t = acos(u) when [lo, hi] lies in [-1, 1] (t increasing as u decreases)."""
    out = [Parameterisation("u", U, T, lo, hi)]
    if lo >= -1.0 and hi <= 1.0:
        out.append(Parameterisation("theta = acos(u)", sympy.acos(U), sympy.cos(T), math.acos(hi), math.acos(lo)))
    return out


@dataclass(frozen=True)
class Table:
    """P_d (and P'_d) sampled at t_j = lo + j h, j < entries, in fp32 [entries, degrees], row-major."""

    param: Parameterisation
    entries: int
    degrees: int
    values: np.ndarray
    derivs: np.ndarray
    error: float  # measured basis max relative error (values), fp32 pipeline
    derror: float  # the same for the derivative table
    budget: float

    @property
    def h(self) -> float:
        return (self.param.hi - self.param.lo) / (self.entries - 1)

    @property
    def nbytes(self) -> int:
        return int(self.values.nbytes + self.derivs.nbytes)


def _sample(rec: Recurrence, param: Parameterisation, entries: int, degrees: int
            ) -> tuple[np.ndarray, np.ndarray]:
    t = np.linspace(param.lo, param.hi, entries)
    values, derivs = rec.evaluate(param.to_u(t), degrees)
    return values.astype(np.float32), derivs.astype(np.float32)


def _measure(rec: Recurrence, param: Parameterisation, entries: int, degrees: int,
             tables: tuple[np.ndarray, np.ndarray] | None = None, per_interval: int = 4) -> tuple[float, float]:
    """The basis max relative error of a table of `entries` (values, derivatives), through the fp32 pipeline:
    u in fp32 at `per_interval` points inside every interval of the grid (and the grid points), t(u) in fp32,
    fp32 interpolation; compared with P_d(u) in float64 at the same u."""
    values, derivs = tables if tables is not None else _sample(rec, param, entries, degrees)
    h = (param.hi - param.lo) / (entries - 1)
    fractions = (np.arange(per_interval + 1) / per_interval)[:, None]
    t = (param.lo + h * (np.arange(entries - 1)[None, :] + fractions)).ravel()
    u32 = param.to_u(t).astype(np.float32)
    t32 = param.to_t32(u32)
    inv_h = np.float32(1.0 / h)
    pos = np.clip((t32 - np.float32(param.lo)) * inv_h, np.float32(0), np.float32(entries - 1))
    idx = np.minimum(pos.astype(np.int32), entries - 2)
    frac = (pos - idx.astype(np.float32))[:, None]
    exact_v, exact_d = rec.evaluate(u32.astype(np.float64), degrees)
    errors = []
    for table, exact in ((values, exact_v), (derivs, exact_d)):
        approx = table[idx] + frac * (table[idx + 1] - table[idx])
        scale = np.abs(exact).max(axis=0)
        err = np.abs(approx.astype(np.float64) - exact).max(axis=0)
        rel = np.where(scale > 0, err / np.where(scale > 0, scale, 1.0), err)
        errors.append(float(rel.max()))
    return errors[0], errors[1]


def size_for(rec: Recurrence, param: Parameterisation, degrees: int, budget: float) -> int | None:
    """The fewest entries whose measured error (values and derivatives) meets the budget; None above
    MAX_ENTRIES or MAX_TABLE_CELLS. Doubling, then bisection (the error falls like 1/entries^2)."""
    def ok(entries: int) -> bool:
        return max(_measure(rec, param, entries, degrees)) <= budget

    limit = min(MAX_ENTRIES, MAX_TABLE_CELLS // max(1, degrees))
    if limit < 32:
        return None
    hi = 32
    while not ok(hi):
        if hi >= limit:
            return None
        hi = min(hi * 2, limit)
    lo = hi // 2
    if lo < 2 or ok(lo):
        return hi if lo < 2 else lo
    while hi - lo > max(1, hi // 256):  # within 0.4%
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi


@dataclass(frozen=True)
class Choice:
    """What the table search measured: entries needed per candidate (None: over MAX_ENTRIES) and the table."""

    needed: tuple[tuple[str, int | None], ...]
    table: Table | None


@functools.lru_cache(maxsize=64)
def choose_table(rec: Recurrence, degrees: int, lo: float, hi: float, budget: float = ERROR_BUDGET) -> Choice:
    needed: list[tuple[str, int | None]] = []
    best: tuple[int, Parameterisation] | None = None
    for param in candidates(lo, hi):
        n = size_for(rec, param, degrees, budget)
        needed.append((param.name, n))
        if n is not None and (best is None or n < best[0]):
            best = (n, param)
    if best is None:
        return Choice(tuple(needed), None)
    entries, param = best
    values, derivs = _sample(rec, param, entries, degrees)
    error, derror = _measure(rec, param, entries, degrees, (values, derivs), per_interval=8)
    return Choice(tuple(needed), Table(param, entries, degrees, values, derivs, error, derror, budget))
