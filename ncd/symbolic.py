"""IR scalar expressions <-> sympy, and sympy -> Triton source text.

Gradients are derived here: sympy differentiates the spec's formulas, and `triton_expr` prints the result as
Triton code. Only numbers and the function's own parameter reach the printed text."""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from typing import ClassVar

import sympy
from sympy.core.relational import Relational
from sympy.printing.str import StrPrinter

from . import ir

# The binary operators as values (comparisons are masks, not values: they are leaves of the walk)
ARITHMETIC: dict[str, Callable[[sympy.Expr, sympy.Expr], sympy.Expr]] = {
    "+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv, "max": sympy.Max,
    "min": sympy.Min,
}

# What a leaf hook decides: a node's sympy form, or None for the walk's default (a number for a constant, the
# axis size for size(...), the bound symbol for a variable; any other kind is "not a scalar expression").
LeafHook = Callable[[ir.Node], sympy.Expr | None]


def to_sympy(node: ir.Node, axes: Mapping[str, ir.Axis] | None = None,
             variables: Mapping[str, sympy.Expr] | None = None, *, leaf: LeafHook | None = None,
             functions: Mapping[str, Callable[[sympy.Expr], sympy.Expr]] | None = None,
             arithmetic: Mapping[str, Callable[[sympy.Expr, sympy.Expr], sympy.Expr]] = ARITHMETIC,
             exponent: Callable[[sympy.Expr], sympy.Expr | int] | None = None) -> sympy.Expr:
    """A scalar IR expression as sympy: the one walk over the IR's arithmetic that every converter shares.

    The walk knows the operators: negation and the element-wise functions (`functions`, default
    SYMPY_FUNCTIONS), the binary operators in `arithmetic` (comparisons are not among them), and integer powers
    (`exponent` maps a power's exponent first, before its base is converted). Every other node is a leaf, handed
    to `leaf` (loads, variables, sizes, sums, ...), which returns its sympy form, None for the default, or raises
    the caller's located error. Defaults: constants are exact numbers, size(AXIS) is the axis size from `axes`, a
    variable is its entry in `variables` or an integer symbol of its name; anything else raises TypeError."""
    fns = SYMPY_FUNCTIONS if functions is None else functions

    def walk(n: ir.Node) -> sympy.Expr:
        if isinstance(n, ir.Unary) and (n.fn == "neg" or n.fn in fns):
            arg = walk(n.arg)
            return -arg if n.fn == "neg" else fns[n.fn](arg)
        if isinstance(n, ir.Binary) and not n.boolean and n.op in arithmetic:
            lhs = walk(n.lhs)
            return arithmetic[n.op](lhs, walk(n.rhs))
        if isinstance(n, ir.Pow):
            power = n.exponent if exponent is None else exponent(n.exponent)
            return walk(n.base) ** power
        converted = None if leaf is None else leaf(n)
        return _default_leaf(n, axes, variables or {}) if converted is None else converted

    return walk(node)


_RELATIONS: dict[str, type[Relational]] = {
    "<": sympy.Lt, "<=": sympy.Le, ">": sympy.Gt, ">=": sympy.Ge, "==": sympy.Eq, "!=": sympy.Ne,
}


def condition_to_sympy(node: ir.Node, axes: Mapping[str, ir.Axis] | None = None, *,
                       leaf: LeafHook | None = None) -> sympy.Basic:
    """An IR condition (a comparison, and/or of conditions, not of a condition) as a sympy boolean: And, Or and Not
    of relationals (Lt, Le, Gt, Ge, Eq, Ne), unevaluated so that the spec's structure survives (`key <= key` stays
    a relational, not True). Each comparison's sides are converted by `to_sympy(side, axes, leaf=leaf)`: the
    caller's leaf hook decides what axis positions, loads and scalar inputs become. Anything else (a number where a
    condition belongs) raises TypeError, as `to_sympy` does for what is not a scalar expression."""
    if isinstance(node, ir.Unary) and node.fn == "not":
        return sympy.Not(condition_to_sympy(node.arg, axes, leaf=leaf), evaluate=False)
    if isinstance(node, ir.Binary) and node.op in ir.LOGICAL:
        join = sympy.And if node.op == "and" else sympy.Or
        return join(condition_to_sympy(node.lhs, axes, leaf=leaf), condition_to_sympy(node.rhs, axes, leaf=leaf),
                    evaluate=False)
    if isinstance(node, ir.Binary) and node.op in _RELATIONS:
        lhs, rhs = to_sympy(node.lhs, axes, leaf=leaf), to_sympy(node.rhs, axes, leaf=leaf)
        return _RELATIONS[node.op](lhs, rhs, evaluate=False)
    raise TypeError(f"{type(node).__name__} is not a condition")


def _default_leaf(node: ir.Node, axes: Mapping[str, ir.Axis] | None,
                  variables: Mapping[str, sympy.Expr]) -> sympy.Expr:
    if isinstance(node, ir.Const):
        value = node.value
        return sympy.Integer(int(value)) if value == int(value) else sympy.Rational(str(value))
    if isinstance(node, ir.SizeOf):
        if axes is None:
            raise TypeError("size() needs the program's axes")
        return axes[node.axis].size
    if isinstance(node, ir.Var):
        return variables.get(node.name) or sympy.Symbol(node.name, integer=True)
    raise TypeError(f"{type(node).__name__} is not a scalar expression")


def lambda_to_sympy(fn: ir.Lambda, symbol: sympy.Symbol, axes: Mapping[str, ir.Axis] | None = None) -> sympy.Expr:
    """A spec's scalar map as sympy in `symbol`; size(...) in its body is the axis size where `axes` is given."""
    return to_sympy(fn.body, axes, {fn.param: symbol})


class SignPlus(sympy.Function):
    """sign(u) with sign(0) = +1: ncd's derivative of |u| (the KAT reference kernels' convention)."""

    @classmethod
    def eval(cls, arg: sympy.Expr) -> sympy.Expr | None:
        if arg.is_number and arg.is_real:
            return sympy.Integer(1) if arg >= 0 else sympy.Integer(-1)
        return None

    def fdiff(self, argindex: int = 1) -> sympy.Expr:
        return sympy.Integer(0)  # almost everywhere


class AbsPlus(sympy.Function):
    """|u| whose derivative is SignPlus(u): d|u|/du at u = 0 is +1 (docs/language.md, "Derivatives of abs")."""

    @classmethod
    def eval(cls, arg: sympy.Expr) -> sympy.Expr | None:
        if arg.is_number and arg.is_real:
            return sympy.Abs(arg)
        return None

    def fdiff(self, argindex: int = 1) -> sympy.Expr:
        return SignPlus(self.args[0])


SYMPY_FUNCTIONS = {
    "abs": sympy.Abs, "sign": sympy.sign, "exp": sympy.exp, "log": sympy.log, "sqrt": sympy.sqrt,
    "tanh": sympy.tanh, "sigmoid": lambda x: 1 / (1 + sympy.exp(-x)), "sin": sympy.sin, "cos": sympy.cos,
    "acos": sympy.acos,
}


class TritonPrinter(StrPrinter):
    """Prints a sympy expression in fp32 Triton: integer powers unrolled, functions from `tl`."""

    _FUNCS: ClassVar[dict[str, str]] = {
        "exp": "tl.exp", "log": "tl.log", "sqrt": "tl.sqrt", "Abs": "tl.abs", "sin": "tl.sin", "cos": "tl.cos",
    }

    def _print_Float(self, expr: sympy.Float) -> str:
        return repr(float(expr))

    def _print_Integer(self, expr: sympy.Integer) -> str:
        return f"{int(expr)}.0"

    def _print_Rational(self, expr: sympy.Rational) -> str:
        return repr(float(expr))

    def _print_Half(self, expr: sympy.Expr) -> str:
        return "0.5"

    def _print_Exp1(self, expr: sympy.Expr) -> str:
        return repr(float(sympy.E))

    def _print_Pi(self, expr: sympy.Expr) -> str:
        return repr(float(sympy.pi))

    def _print_Symbol(self, expr: sympy.Symbol) -> str:
        if not expr.name.isidentifier():
            raise ValueError(f"symbol {expr.name!r} is not an identifier")
        return expr.name

    def _print_Function(self, expr: sympy.Function) -> str:
        name = type(expr).__name__
        args = ", ".join(self._print(a) for a in expr.args)
        if name in self._FUNCS:
            return f"{self._FUNCS[name]}({args})"
        if name == "tanh":  # tl has no tanh on every backend: 2 sigmoid(2x) - 1
            return f"(2.0 * tl.sigmoid(2.0 * ({args})) - 1.0)"
        if name == "cosh":
            return f"(0.5 * (tl.exp({args}) + tl.exp(-({args}))))"
        if name == "sinh":
            return f"(0.5 * (tl.exp({args}) - tl.exp(-({args}))))"
        if name == "sign":
            return f"tl.where(({args}) > 0, 1.0, tl.where(({args}) < 0, -1.0, 0.0))"
        if name == "acos":
            raise ValueError("acos has no Triton lowering here")
        raise ValueError(f"no Triton lowering for {name}")

    _print_exp = _print_log = _print_sin = _print_cos = _print_tanh = _print_sign = _print_Function
    _print_cosh = _print_sinh = _print_Function

    def _print_Abs(self, expr: sympy.Abs) -> str:
        return f"tl.abs({self._print(expr.args[0])})"

    # acos(u) on [-1, 1] by Abramowitz & Stegun 4.4.46, |error| <= 2e-8 (fp32: about 4e-7, as np.arccos in
    # fp32), with acos(-u) = pi - acos(u): tl has no acos, and libdevice does not run in the CPU interpreter.
    _ACOS = (1.5707963050, -0.2145988016, 0.0889789874, -0.0501743046, 0.0308918810, -0.0170881256,
             0.0066700901, -0.0012624911)

    def _print_acos(self, expr: sympy.Expr) -> str:
        u = self._print(expr.args[0])
        a = f"tl.abs({u})"
        poly = repr(self._ACOS[-1])
        for c in reversed(self._ACOS[:-1]):
            poly = f"({poly} * {a} + {c!r})"
        return f"tl.where(({u}) >= 0, tl.sqrt(1.0 - {a}) * {poly}, {float(sympy.pi)!r} - tl.sqrt(1.0 - {a}) * {poly})"

    def _print_AbsPlus(self, expr: sympy.Expr) -> str:
        return f"tl.abs({self._print(expr.args[0])})"

    def _print_SignPlus(self, expr: sympy.Expr) -> str:  # sign with sign(0) = +1; NaN at NaN
        a = self._print(expr.args[0])
        return f"tl.where(({a}) >= 0, 1.0, tl.where(({a}) < 0, -1.0, ({a})))"

    def _print_Heaviside(self, expr: sympy.Expr) -> str:
        # d/dx max(a, b) = H(a - b) a' + H(b - a) b'. With H(0) = 1/2 a tie takes the mean of both sides' slopes:
        # a subgradient of max(x, c x) at 0 (H(0) = 0 gave 0 on both sides), and what torch.maximum's backward
        # (the float64 reference) and sympy's own Heaviside(0) give. NaN at NaN.
        a = self._print(expr.args[0])
        at_zero = self._print(expr.args[1]) if len(expr.args) > 1 else "0.5"
        return f"tl.where(({a}) > 0, 1.0, tl.where(({a}) < 0, 0.0, tl.where(({a}) == 0, {at_zero}, ({a}))))"

    # NaN in, NaN out (float maps); a printer of integer bounds turns it off (Triton's default)
    NAN_ARGUMENT = ", propagate_nan=tl.PropagateNan.ALL"

    def _print_Max(self, expr: sympy.Expr) -> str:
        out = self._print(expr.args[0])
        for a in expr.args[1:]:
            out = f"tl.maximum({out}, {self._print(a)}{self.NAN_ARGUMENT})"
        return out

    def _print_Min(self, expr: sympy.Expr) -> str:
        out = self._print(expr.args[0])
        for a in expr.args[1:]:
            out = f"tl.minimum({out}, {self._print(a)}{self.NAN_ARGUMENT})"
        return out

    def _print_Pow(self, expr: sympy.Pow, rational: bool = False) -> str:
        base, exp = expr.args
        b = self.parenthesize(base, 100)
        if exp == sympy.Rational(1, 2):
            return f"tl.sqrt({self._print(base)})"
        if exp == -sympy.Rational(1, 2):
            return f"(1.0 / tl.sqrt({self._print(base)}))"
        if exp.is_Integer:
            n = int(exp)
            if n == 0:
                return "1.0"
            product = " * ".join([b] * abs(n))
            return f"({product})" if n > 0 else f"(1.0 / ({product}))"
        if exp.is_Rational:
            return f"tl.exp({float(exp)!r} * tl.log({self._print(base)}))"
        return f"tl.exp(({self._print(exp)}) * tl.log({self._print(base)}))"


def triton_expr(expr: sympy.Expr) -> str:
    return TritonPrinter().doprint(expr)


class TorchPrinter(StrPrinter):
    """Prints a sympy expression of one variable as torch code (the factorized attention's b(z))."""

    _FUNCS: ClassVar[dict[str, str]] = {
        "exp": "torch.exp", "log": "torch.log", "sqrt": "torch.sqrt", "Abs": "torch.abs", "tanh": "torch.tanh",
        "sin": "torch.sin", "cos": "torch.cos",
    }

    def __init__(self, variable: sympy.Symbol) -> None:
        super().__init__()
        self.variable = variable

    def _print_Symbol(self, expr: sympy.Symbol) -> str:
        if expr != self.variable:
            raise ValueError(f"unexpected symbol {expr}")
        return expr.name

    def _print_Float(self, expr: sympy.Float) -> str:
        return repr(float(expr))

    def _print_Rational(self, expr: sympy.Rational) -> str:
        return repr(float(expr))

    def _print_Integer(self, expr: sympy.Integer) -> str:
        return f"{int(expr)}.0"

    def _print_Function(self, expr: sympy.Function) -> str:
        name = type(expr).__name__
        if name not in self._FUNCS:
            raise ValueError(f"no torch lowering for {name}")
        return f"{self._FUNCS[name]}({', '.join(self._print(a) for a in expr.args)})"

    _print_exp = _print_log = _print_sin = _print_cos = _print_tanh = _print_Function

    def _print_Abs(self, expr: sympy.Abs) -> str:
        return f"torch.abs({self._print(expr.args[0])})"

    def _print_Pow(self, expr: sympy.Pow, rational: bool = False) -> str:
        base, exp = expr.args
        if exp == sympy.Rational(1, 2):
            return f"torch.sqrt({self._print(base)})"
        if exp == -sympy.Rational(1, 2):
            return f"torch.rsqrt({self._print(base)})"
        return f"({self.parenthesize(base, 100)} ** {float(exp)!r})"


def torch_expr(expr: sympy.Expr, variable: sympy.Symbol) -> str:
    return TorchPrinter(variable).doprint(expr)
