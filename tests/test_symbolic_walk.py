"""The one IR -> sympy walk (`ncd.symbolic.to_sympy`): the operators are walked once, every leaf goes to the
caller's hook, and the hook's None, value or error decides what the leaf becomes."""

from __future__ import annotations

import pytest
import sympy

from ncd import ir
from ncd.pipeline import front_end
from ncd.source import NO_SPAN
from ncd.symbolic import ARITHMETIC, AbsPlus, lambda_to_sympy, to_sympy

SPEC = """spec walk
axis row, col = 5
in  x[row col] : f32
in  s : f32
out y[row col] = max(-x, 0.25) * 3 + exp(x / s)^2 - size(col) * abs(x)
"""


def _program() -> ir.Program:
    return front_end(SPEC, "walk.ncd").program


def _output(program: ir.Program) -> ir.Node:
    return program.definition("y").value


def test_leaves_go_to_the_hook_and_operators_are_walked_once():
    program = _program()
    axes = {a.name: a for a in program.axes}
    x, s = sympy.symbols("x s", positive=True)
    seen: list[str] = []

    def leaf(node: ir.Node) -> sympy.Expr | None:
        seen.append(type(node).__name__)
        if isinstance(node, ir.Load):
            return {"x": x, "s": s}[node.tensor]
        return None  # constants and sizes: the walk's default

    expr = to_sympy(_output(program), axes, leaf=leaf)
    assert sympy.simplify(expr - (sympy.Max(-x, sympy.Rational(1, 4)) * 3 + sympy.exp(x / s) ** 2 - 5 * abs(x))) == 0
    # every leaf of the expression, and no operator node, reached the hook
    assert sorted(seen) == sorted(["Load", "Const", "Const", "Load", "Load", "SizeOf", "Load"])


def test_the_hook_decides_functions_arithmetic_and_exponents():
    program = _program()
    axes = {a.name: a for a in program.axes}
    x = sympy.Symbol("x", real=True)

    def leaf(node: ir.Node) -> sympy.Expr | None:
        if isinstance(node, ir.Load):
            return x if node.tensor == "x" else sympy.Integer(2)
        if isinstance(node, ir.Binary):  # only reaches the hook when `arithmetic` leaves the operator out
            raise ValueError(f"no {node.op} here")
        return None

    with_abs_plus = to_sympy(_output(program), axes, leaf=leaf, functions={"exp": sympy.exp, "abs": AbsPlus})
    assert with_abs_plus.has(AbsPlus) and not with_abs_plus.has(sympy.Abs)
    no_max = {op: f for op, f in ARITHMETIC.items() if op != "max"}
    with pytest.raises(ValueError, match="no max here"):
        to_sympy(_output(program), axes, leaf=leaf, arithmetic=no_max)
    cubed = to_sympy(_output(program), axes, leaf=leaf, exponent=lambda e: e + 1)
    assert cubed.has(sympy.exp(x / 2) ** 3) or cubed.has(sympy.exp(3 * x / 2))


def test_defaults_without_a_hook():
    program = _program()
    axes = {a.name: a for a in program.axes}
    assert to_sympy(ir.Const(0.1, NO_SPAN)) == sympy.Rational(1, 10)  # exact, from the decimal text
    assert to_sympy(ir.SizeOf("col", NO_SPAN), axes) == 5
    assert to_sympy(ir.SizeOf("row", NO_SPAN), axes).free_symbols  # bound at call time: a size symbol
    with pytest.raises(TypeError, match="needs the program's axes"):
        to_sympy(ir.SizeOf("col", NO_SPAN))
    with pytest.raises(TypeError, match="Load is not a scalar expression"):
        to_sympy(_output(program), axes)
    comparison = ir.Binary("<", ir.Const(1.0, NO_SPAN), ir.Const(2.0, NO_SPAN), (), NO_SPAN)
    with pytest.raises(TypeError, match="Binary is not a scalar expression"):
        to_sympy(comparison)
    t = sympy.Symbol("t")
    fn = ir.Lambda("u", ir.Binary("*", ir.Var("u", NO_SPAN), ir.SizeOf("col", NO_SPAN), (), NO_SPAN), NO_SPAN)
    assert lambda_to_sympy(fn, t, axes) == 5 * t
