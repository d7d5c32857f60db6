"""Overflow-safe printing of element-wise maps that hold exponentials.

A map printed as written can form inf/inf, inf - inf or 0 * inf where its true value is finite: sigmoid's derivative
exp(-x) / (1 + exp(-x))^2 is inf/inf below x = -88 in fp32. When a map is a rational function of one exponential
e = exp(g(x)) (every exponential in it is exp(n g(x)) for an integer n; coefficients are any non-exponential
functions of x), it is rewritten as

    where(g <= 0, N(u) / D(u), N~(u) / D~(u)),   u = exp(-|g|) <= 1,

with R = N(e) / D(e) and N~(u) = u^k N(1/u), D~(u) = u^k D(1/u), k the largest degree in e: multiplying numerator
and denominator by e^-k turns R into a rational function of 1/e. Both branches evaluate only u in [0, 1], and the
denominators are checked to have no root on [0, 1], so neither branch overflows or divides by zero (not even the
unselected one, which `tl.where` evaluates too). tanh, sinh and cosh are written as exponentials first.

Maps that are already safe print exactly as before: no exponential, or a single term C(x) e^n (exp(c x) under the
running-max rescale overflows only where its value does). A map holding exponentials that fits neither form is
rejected with the reason (ValueError), never printed unsafe."""

from __future__ import annotations

from functools import reduce

import sympy
from sympy.core.function import Application

from .symbolic import TritonPrinter, triton_expr

_E = sympy.Symbol("_e", positive=True)  # e = exp(g(x))
_U = sympy.Symbol("_u", nonnegative=True)  # u = exp(-|g(x)|) in [0, 1]


class UnsafeExponential(ValueError):
    """A map with exponentials that can overflow where its value is finite, in no form the rewrite handles."""


class _BranchPrinter(TritonPrinter):
    def __init__(self, u_text: str) -> None:
        super().__init__()
        self.u_text = u_text

    def _print_Symbol(self, expr: sympy.Symbol) -> str:
        return self.u_text if expr == _U else super()._print_Symbol(expr)


def _exponentials(expr: sympy.Expr, var: sympy.Symbol) -> list[sympy.Expr]:
    return sorted((a for a in expr.atoms(sympy.exp) if var in a.free_symbols), key=sympy.default_sort_key)


def _common_exponent(args: list[sympy.Expr]) -> tuple[sympy.Expr, list[int]] | None:
    """(g, n) with args[i] = n[i] g, n integers, g with a positive leading sign; None if no such g."""
    first = args[0]
    ratios = [r if (r := a / first).is_Rational else sympy.cancel(r) for a in args]
    if not all(r.is_Rational for r in ratios):
        return None
    rationals = [sympy.Rational(r) for r in ratios]
    step = sympy.Rational(reduce(sympy.gcd, [r.p for r in rationals]), reduce(sympy.ilcm, [r.q for r in rationals]))
    g = sympy.expand(first * step)
    counts = [int(r / step) for r in rationals]
    if g.could_extract_minus_sign():
        g, counts = -g, [-n for n in counts]
    return g, counts


def _has_root_in_unit_interval(den: sympy.Poly) -> bool:
    return den.is_zero or den.count_roots(0, 1) > 0


def stabilise(expr: sympy.Expr, var: sympy.Symbol) -> tuple[sympy.Expr, sympy.Expr, sympy.Expr, sympy.Expr] | None:
    """(g, branch for g <= 0, branch for g > 0, both in u = exp(-|g|)) for a map that needs the rewrite; None for a
    map that prints safely as written. Raises UnsafeExponential for exponentials in no form the rewrite handles.
    tanh, sinh, cosh are rewritten as exponentials where that gives the form; otherwise they stay as they are
    (tanh prints as 2 sigmoid(2 u) - 1, finite everywhere: tanh(tanh(x)) still compiles)."""
    if expr.atoms(sympy.tanh, sympy.sinh, sympy.cosh) and var in expr.free_symbols:
        try:
            return _stabilise(expr.rewrite(sympy.exp), var)
        except UnsafeExponential:
            pass
    return _stabilise(expr, var)


def _stabilise(expr: sympy.Expr, var: sympy.Symbol) -> tuple[sympy.Expr, sympy.Expr, sympy.Expr, sympy.Expr] | None:
    expr = expr.replace(lambda p: isinstance(p, sympy.Pow) and var in p.exp.free_symbols  # b^x = exp(x log b)
                        and var not in p.base.free_symbols, lambda p: sympy.exp(p.exp * sympy.log(p.base)))
    exps = _exponentials(expr, var)
    if not exps:
        return None
    common = _common_exponent([a.args[0] for a in exps])
    if common is None:
        raise UnsafeExponential(f"{expr} holds exponentials {', '.join(map(str, exps))} that are not powers of one "
                                "exponential, so it cannot be evaluated without overflow where its value is finite")
    g, counts = common
    in_e = expr.xreplace({a: _E**n for a, n in zip(exps, counts, strict=True)})
    if _exponentials(in_e, var) or any(_E in f.free_symbols for f in in_e.atoms(Application)):
        raise UnsafeExponential(f"{expr}: an exponential of x sits inside another function, so it cannot be "
                                "evaluated without overflow where its value is finite")
    num, den = sympy.fraction(sympy.cancel(sympy.together(in_e)))
    den_x, den_e = sympy.factor(den).as_independent(_E, as_Add=False)
    try:
        p_num, p_den = sympy.Poly(num, _E), sympy.Poly(den_e, _E)
    except sympy.PolynomialError:
        raise UnsafeExponential(f"{expr} is not a rational function of exp({g})") from None
    if p_den.free_symbols - {_E}:
        raise UnsafeExponential(f"{expr}: the denominator's exponential terms have coefficients that depend on x")
    if len(p_num.terms()) <= 1 and len(p_den.terms()) <= 1:
        return None  # C(x) exp(n g): overflows only where its value does
    k = max(p_num.degree(), p_den.degree())
    num_low, den_low = p_num.as_expr().subs(_E, _U), p_den.as_expr().subs(_E, _U)
    num_high = sympy.expand(_U**k * p_num.as_expr().subs(_E, 1 / _U))
    den_high = sympy.expand(_U**k * p_den.as_expr().subs(_E, 1 / _U))
    for den_u in (den_low, den_high):
        if _has_root_in_unit_interval(sympy.Poly(den_u, _U)):
            raise UnsafeExponential(f"{expr} divides by {sympy.factor(den_u.subs(_U, sympy.exp(-abs(g))))}, which "
                                    f"vanishes or underflows for some x, so it cannot be evaluated without overflow")
    low = num_low / _fewest_operations(den_low) / den_x
    high = num_high / _fewest_operations(den_high) / den_x
    return g, low, high, _U


def _fewest_operations(poly: sympy.Expr) -> sympy.Expr:
    """poly expanded or factored, whichever costs fewer operations ((1 + u)^2 rather than u^2 + 2 u + 1)."""
    return min((poly, sympy.factor(poly)), key=sympy.count_ops)


def stable_triton_expr(expr: sympy.Expr, var: sympy.Symbol) -> str:
    """`expr` as Triton text that forms no inf/inf, inf - inf or 0 * inf from an exponential of `var` where its
    value is finite (the module docstring); exactly `triton_expr(expr)` for maps that are safe as written."""
    rewrite = stabilise(expr, var)
    if rewrite is None:
        return triton_expr(expr)
    g, low, high, _ = rewrite
    g_text = triton_expr(g)
    printer = _BranchPrinter(f"tl.exp(-tl.abs({g_text}))")
    if low == high:  # symmetric in e <-> 1/e (sigmoid's derivative): one branch serves both signs of g
        return printer.doprint(low)
    return f"tl.where(({g_text}) <= 0, {printer.doprint(low)}, {printer.doprint(high)})"

