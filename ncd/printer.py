"""Readable text forms of the AST and the IR (`ncd compile --emit ast|ir`)."""

from __future__ import annotations

import dataclasses

import sympy

from . import ast, ir
from .source import Span

# Binding strength, loosest first (docs/language.md §8): a child looser than its parent is parenthesised.
_PREC = {"or": 1, "and": 2, "not": 3, "cmp": 4, "+": 5, "-": 5, "*": 6, "/": 6, "neg": 7, "^": 8}


def format_ast(module: ast.Module) -> str:
    lines = [f"Module {module.source.filename}"]
    for stmt in module.statements:
        _ast_lines(stmt, 1, lines)
    return "\n".join(lines)


def _ast_lines(node: object, depth: int, out: list[str], label: str = "") -> None:
    pad = "  " * depth + (f"{label}: " if label else "")
    if isinstance(node, ast.Ident):
        out.append(f"{pad}{node.name!r} @{node.span.line}:{node.span.col}")
        return
    if isinstance(node, tuple):
        for i, item in enumerate(node):
            _ast_lines(item, depth, out, f"{label}[{i}]" if label else f"[{i}]")
        return
    if not dataclasses.is_dataclass(node):
        out.append(f"{pad}{node!r}")
        return
    span = getattr(node, "span", None)
    where = f" @{span.line}:{span.col}" if isinstance(span, Span) else ""
    out.append(f"{pad}{type(node).__name__}{where}")
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if f.name == "span" or value is None or value == ():
            continue
        _ast_lines(value, depth + 1, out, f.name)


def format_ir(program: ir.Program) -> str:
    out = [f"spec {program.name}"]
    for a in program.axes:
        extra = f" = {' * '.join(a.factors)}" if a.factors else (f" = {a.alias_of}" if a.alias_of else "")
        out.append(f"axis {a.name}{extra} : {_size(a.size)}{_origin(a.span)}")
    for name, value in program.constants:
        out.append(f"const {name} = {value:g}")
    for b in program.bases:
        terms = ", ".join(f"{b.name}[{i}] = {format_node(t)}" for i, t in enumerate(b.initial))
        out.append(f"basis {b.name}({b.param}): {terms}, {b.name}[{b.step_var}+1] = {format_node(b.step)}"
                   f"{_origin(b.span)}")
    for t in program.tensors:
        if t.role in ("in", "param"):
            default = f" = {format_node(t.default)}" if t.default is not None else ""
            out.append(f"{t.role} {t.name}[{' '.join(t.axes)}] : {t.dtype}{default}{_origin(t.span)}")
    for d in program.definitions:
        t = program.tensor(d.tensor)
        role = "out " if t.role == "out" else ""
        dtype = f" : {t.dtype}" if t.dtype else ""
        out.append(f"{role}{t.name}[{' '.join(t.axes)}]{dtype} = {format_node(d.value)}{_origin(d.span)}")
    return "\n".join(out)


def _origin(span: Span) -> str:
    return f"    # {span.origin}" if span.line else ""


def _size(size: sympy.Expr) -> str:
    return str(size) if size.is_Integer else f"{size} (bound at call)"


def _axes(node: ir.Node) -> str:
    return f"[{' '.join(node.axes)}]"


def format_node(node: ir.Node, parent: int = 0) -> str:
    if isinstance(node, ir.Const):
        return node.name or f"{node.value:g}"
    if isinstance(node, ir.SizeOf):
        return f"size({node.axis})"
    if isinstance(node, ir.Load):
        parts = [i.axis if i.axis is not None else str(i.index).replace(" ", "") for i in node.index]
        return f"{node.tensor}[{' '.join(parts)}]"
    if isinstance(node, ir.AxisIndex):
        return f"#{node.axis}"
    if isinstance(node, ir.Var):
        return node.name
    if isinstance(node, ir.Unary):
        if node.fn == "neg":
            return _paren(f"-{format_node(node.arg, _PREC['neg'])}", _PREC["neg"], parent)
        if node.fn == "not":
            return _paren(f"not {format_node(node.arg, _PREC['not'])}", _PREC["not"], parent)
        return f"{node.fn}({format_node(node.arg)})"
    if isinstance(node, ir.Binary):
        if node.op in ("max", "min"):
            return f"{node.op}({format_node(node.lhs)}, {format_node(node.rhs)})"
        prec = _PREC.get(node.op, _PREC["cmp"])
        text = f"{format_node(node.lhs, prec)} {node.op} {format_node(node.rhs, prec + 1)}"
        return _paren(text, prec, parent)
    if isinstance(node, ir.Pow):
        return _paren(f"{format_node(node.base, _PREC['^'] + 1)}^{node.exponent}", _PREC["^"], parent)
    if isinstance(node, ir.Where):
        return f"where({format_node(node.cond)}, {format_node(node.then)}, {format_node(node.otherwise)})"
    if isinstance(node, ir.FiniteSum):
        return f"sum({format_node(node.body)} for {node.var} in {node.lo}..{node.hi})"
    if isinstance(node, ir.Reduce):
        return f"{node.op}({format_node(node.arg)}, over {' '.join(node.over)}){_axes(node)}"
    if isinstance(node, ir.Contract):
        return f"contract({format_node(node.lhs)}, {format_node(node.rhs)}; over {' '.join(node.over)}){_axes(node)}"
    if isinstance(node, ir.Lambda):
        return f"{node.param} -> {format_node(node.body)}"
    if isinstance(node, ir.Normalize):
        extras = "".join(f", {k} = {format_node(v)}" for k, v in
                         (("mask", node.mask), ("weight", node.weight), ("sink", node.sink)) if v is not None)
        return (f"normalize({format_node(node.arg)}, over {node.over}, a1 = {format_node(node.a1)}, "
                f"a2 = {format_node(node.a2)}, b = {format_node(node.b)}{extras}){_axes(node)}")
    if isinstance(node, ir.BasisEval):
        return f"{node.basis}[{node.index}]({format_node(node.arg)}){_axes(node)}"
    if isinstance(node, ir.BasisTerm):
        return f"term[n-{node.back}]" if node.back else "term[n]"
    if isinstance(node, ir.Prev):
        return f"prev{_axes(node)}"
    if isinstance(node, ir.Scan):
        init = f", init = {format_node(node.init)}" if node.init is not None else ""
        return f"scan({format_node(node.body)}, over {node.over}{init}){_axes(node)}"
    if isinstance(node, ir.ChebyshevSolve):
        return (f"chebyshev_solve({format_node(node.matrix)}, {format_node(node.rhs)}, rows {node.row}, over "
                f"{node.over}, iterations = {node.iterations}, mu = {format_node(node.mu)}, "
                f"L = {format_node(node.lipschitz)}){_axes(node)}")
    raise TypeError(f"no printer for {type(node).__name__}")


def _paren(text: str, prec: int, parent: int) -> str:
    return f"({text})" if prec < parent else text
