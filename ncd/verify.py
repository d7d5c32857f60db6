"""IR invariants, checked after every stage. A failure here is a compiler bug, not a user mistake."""

from __future__ import annotations

import sympy

from . import ir
from .index_expr import Position, integer_valued, load_axes


def _fail(where: str, why: str) -> None:
    raise ir.IRVerificationError(f"{where}: {why}")


def verify_program(program: ir.Program) -> None:
    axes = {a.name: a for a in program.axes}
    for axis in program.axes:
        if not isinstance(axis.size, sympy.Expr) or not axis.size.free_symbols <= {
            s for s in axis.size.free_symbols if s.is_integer and s.is_positive
        }:
            _fail(axis.name, f"size {axis.size!r} is not a positive integer expression")
        if axis.factors:
            if any(f not in axes for f in axis.factors):
                _fail(axis.name, "split into undeclared factors")
            if sympy.simplify(axis.size - sympy.Mul(*[axes[f].size for f in axis.factors])) != 0:
                _fail(axis.name, "size differs from the product of its factors")
    tensors = {t.name: t for t in program.tensors}
    if len(tensors) != len(program.tensors):
        _fail(program.name, "duplicate tensor names")
    for t in program.tensors:
        if t.role not in ("in", "param", "out", "let"):
            _fail(t.name, f"bad role {t.role}")
        if t.dtype is not None and t.dtype not in ir.DTYPES:
            _fail(t.name, f"bad dtype {t.dtype}")
        if any(a not in axes for a in t.axes):
            _fail(t.name, "undeclared axis")
    defined: set[str] = {t.name for t in program.tensors if t.role in ("in", "param")}
    for d in program.definitions:
        tensor = tensors.get(d.tensor)
        if tensor is None or tensor.role not in ("out", "let"):
            _fail(d.tensor, "defines something that is not an output or intermediate")
            return
        if d.tensor in defined:
            _fail(d.tensor, "defined twice, or defines an input")
        _verify_node(d.value, axes, tensors, defined, bound=set(), in_scan=False, where=d.tensor)
        for a in d.value.axes:
            owners = [o for o in tensor.axes if a in axes[o].factors]
            if a not in tensor.axes and not owners:
                _fail(d.tensor, f"value carries axis {a} the tensor lacks")
        defined.add(d.tensor)
    missing = [t.name for t in program.tensors if t.role in ("out", "let") and t.name not in defined]
    if missing:
        _fail(program.name, f"never defined: {missing}")


def _verify_node(node: ir.Node, axes: dict, tensors: dict, defined: set[str], bound: set[str],
                 in_scan: bool, where: str) -> None:
    if any(a not in axes for a in node.axes):
        _fail(where, f"{type(node).__name__} carries an undeclared axis")
    if len(set(node.axes)) != len(node.axes):
        _fail(where, f"{type(node).__name__} repeats an axis")
    if isinstance(node, ir.Load):
        if node.tensor not in defined:
            _fail(where, f"reads {node.tensor} before it is defined")
        if len(node.index) != len(tensors[node.tensor].axes):
            _fail(where, f"reads {node.tensor} with the wrong rank")
        if load_axes(node.index, list(axes)) != node.axes:
            _fail(where, f"load of {node.tensor} disagrees with its index")
        for index in node.index:
            if index.index is not None:
                _verify_index(index.index, axes, tensors, bound, where)
    elif isinstance(node, ir.Var) and node.name not in bound:
        _fail(where, f"variable {node.name} is not bound")
    elif isinstance(node, ir.Prev) and not in_scan:
        _fail(where, "prev outside a scan")
    elif isinstance(node, ir.Contract | ir.Reduce):
        operands = [node.lhs, node.rhs] if isinstance(node, ir.Contract) else [node.arg]
        for axis in node.over:
            if any(axis not in o.axes for o in operands):
                _fail(where, f"reduces over {axis}, which an operand lacks")
    inner_bound = bound
    if isinstance(node, ir.FiniteSum):
        inner_bound = bound | {node.var}
    elif isinstance(node, ir.Lambda):
        inner_bound = {node.param}
    for child in ir.children(node):
        child_scan = in_scan or (isinstance(node, ir.Scan) and child is node.body)
        _verify_node(child, axes, tensors, defined, inner_bound, child_scan, where)


def _verify_index(index: sympy.Expr, axes: dict, tensors: dict, bound: set[str], where: str) -> None:
    """An index expression reads positions of declared axes, bound sum indices, integer scalar inputs and
    call-time sizes, and is an integer."""
    for symbol in index.free_symbols:
        name = getattr(symbol, "name", "")
        if isinstance(symbol, Position):
            ok = name in axes
        elif symbol.is_positive:
            ok = any(symbol in a.size.free_symbols for a in axes.values())
        else:
            t = tensors.get(name)
            ok = name in bound or (t is not None and t.role == "in" and not t.axes and t.dtype in ("i32", "i64"))
        if not ok:
            _fail(where, f"index {index} reads {name}, which is no position, sum index, integer scalar or size")
    if not integer_valued(index):
        _fail(where, f"index {index} is not an integer")


def verify_basis(basis: ir.Basis) -> None:
    for node in (*basis.initial, basis.step):
        if node.axes:
            _fail(basis.name, "a basis term carries axes")
