"""AST -> axis-typed IR: resolve names, infer and check every wire's axes and sizes.

Broadcasting is by axis name: an element-wise result carries the union of its operands' axes. A factor of a
split axis (`group` of `chan = group * width`) is absorbed by the split axis when both meet: the factor is a
function of the split index, as a per-group parameter is read by every channel of its group.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

import networkx as nx
import sympy

from . import ast, ir
from .errors import (
    ArityError,
    AxisMismatch,
    BadArgument,
    ContractionAxisMissing,
    CyclicDefinition,
    DuplicateName,
    IndexOutOfRange,
    InvalidIdentifier,
    InvalidStatement,
    LimitExceeded,
    NcdError,
    RankMismatch,
    SizeMismatch,
    TypeMismatch,
    UnknownAxis,
    UnknownDtype,
    UnknownFunction,
    UnknownName,
    UnusedInput,
)
from .identifiers import check_identifier, identifier_problem
from .index_expr import load_axes, lower_index
from .limits import MAX_AXIS_SIZE, MAX_EXPONENT, MAX_POWER_BITS, MAX_SUM_TERMS, symbolic_budget
from .source import Span
from .symbolic import to_sympy

STRUCTURAL = ("sum", "max", "min", "clamp", "where", "size", "normalize", "scan", "chebyshev_solve")
FUNCTIONS = (*ir.ELEMENTWISE, *STRUCTURAL)
COMPARISONS = ir.COMPARISONS
CONDITION_HINT = "compare first: x > 0 and y > 0"


@dataclass
class _Scope:
    """What a name can mean at one point of an expression besides the spec's declarations."""

    variables: dict[str, tuple[int, int] | None] = field(default_factory=dict)  # name -> finite-sum range
    scan_axes: tuple[str, ...] | None = None  # the right-hand side is a scan with these declared axes
    prev_axes: tuple[str, ...] | None = None  # inside a scan's body
    scalar_only: str | None = None  # inside an inline function or basis: why tensors are not allowed
    basis: str | None = None  # inside a basis recurrence: the basis name
    step_var: str | None = None

    def child(self, **changes: object) -> _Scope:
        return replace(self, variables=dict(self.variables), **changes)  # type: ignore[arg-type]


def lower(module: ast.Module) -> tuple[ir.Program, list[NcdError]]:
    """Type-check a parsed spec. Returns the program and warnings; raises the first error."""
    with symbolic_budget(module.source, "type-checking the spec"):
        return _Lowering(module).run()


class _Lowering:
    def __init__(self, module: ast.Module) -> None:
        self.module = module
        self.decls: dict[str, tuple[str, ast.Statement]] = {}
        self.axes: dict[str, ir.Axis] = {}
        self.consts: dict[str, float] = {}
        self.tensors: dict[str, ir.Tensor] = {}
        self.bases: dict[str, ir.Basis] = {}
        self.used: set[str] = set()
        self.warnings: list[NcdError] = []

    # --- driver ---------------------------------------------------------------------------------

    def run(self) -> tuple[ir.Program, list[NcdError]]:
        name = self._declare_all()
        for axis_name in self._names("axis"):
            self._axis(axis_name, ())
        for const_name in self._names("const"):
            self._const(const_name, ())
        for stmt in self._stmts(ast.TensorDecl):
            self._declare_tensor(stmt)
        for stmt in self._stmts(ast.BasisDecl):
            self.bases[stmt.name.name] = self._basis(stmt)
        for stmt in self._stmts(ast.Define):
            self.tensors[stmt.name.name] = ir.Tensor(
                stmt.name.name, "let", self._axis_list(stmt.axes or ()), None, stmt.span
            )
        definitions = [self._definition(stmt) for stmt in self._ordered_definitions()]
        self._check_outputs_and_usage()
        program = ir.Program(
            name=name,
            axes=tuple(self.axes[n] for n in self._names("axis")),
            tensors=tuple(self.tensors.values()),
            definitions=tuple(definitions),
            bases=tuple(self.bases.values()),
            constants=tuple(self.consts.items()),
            source=self.module.source,
        )
        return program, self.warnings

    def _stmts(self, kind: type) -> list:
        return [s for s in self._flat() if isinstance(s, kind)]

    def _flat(self) -> list[ast.Statement]:
        return list(self.module.statements)

    def _names(self, kind: str) -> list[str]:
        return [n for n, (k, _) in self.decls.items() if k == kind]

    def _declare_all(self) -> str:
        spec_names = self._stmts(ast.SpecName)
        if len(spec_names) > 1:
            raise InvalidStatement(spec_names[1].span, detail="a spec has one `spec NAME` line")
        kinds = {ast.AxisDecl: "axis", ast.ConstDecl: "const", ast.BasisDecl: "basis", ast.Define: "tensor"}
        for stmt in self._flat():
            if isinstance(stmt, ast.SpecName):
                check_identifier(stmt.name)
                continue
            kind = "tensor" if isinstance(stmt, ast.TensorDecl) else kinds[type(stmt)]
            ident = stmt.name
            check_identifier(ident)
            if ident.name in self.decls:
                prev_kind, prev = self.decls[ident.name]
                raise DuplicateName(ident.span, name=ident.name, kind=prev_kind, line=prev.span.line)
            self.decls[ident.name] = (kind, stmt)
        if not spec_names:  # named after its file: that name reaches generated code too, so check it
            name = self.module.source.filename.rsplit("/", 1)[-1].removesuffix(".ncd").replace("-", "_")
            reason = identifier_problem(name)
            if reason is not None:
                top = Span(self.module.source.filename, 1, 1, 1, 2)
                raise InvalidIdentifier(top, name=name, reason=reason,
                                        hint="a spec without a `spec NAME` line is named after its file; "
                                             "add that line, or rename the file")
            return name
        return spec_names[0].name.name

    # --- axes -----------------------------------------------------------------------------------

    def _axis(self, name: str, visiting: tuple[str, ...]) -> ir.Axis:
        if name in self.axes:
            return self.axes[name]
        stmt = self.decls[name][1]
        assert isinstance(stmt, ast.AxisDecl)
        if name in visiting:
            cycle = " -> ".join([*visiting[visiting.index(name):], name])
            raise CyclicDefinition(stmt.name.span, name=name, cycle=cycle)
        if stmt.kind == "bound":
            axis = ir.Axis(name, sympy.Symbol(name, integer=True, positive=True), span=stmt.span)
        elif stmt.kind == "fixed":
            assert stmt.size is not None
            if stmt.size < 1:
                raise SizeMismatch(stmt.span, detail=f"axis '{name}' must have a positive size, not {stmt.size}")
            axis = ir.Axis(name, sympy.Integer(stmt.size), span=stmt.span)
            _check_axis_size(axis)
        else:
            parts = []
            for factor in stmt.factors:
                if self.decls.get(factor.name, ("",))[0] != "axis":
                    raise UnknownAxis(factor.span, name=factor.name, choices=self._names("axis"))
                part = self._axis(factor.name, (*visiting, name))
                if part.factors:
                    raise InvalidStatement(
                        factor.span, detail=f"'{factor.name}' is itself split; split axes take plain factors"
                    )
                parts.append(part)
            if len(parts) == 1:
                axis = ir.Axis(name, parts[0].size, alias_of=parts[0].name, span=stmt.span)
            else:
                if len({p.name for p in parts}) != len(parts):
                    raise InvalidStatement(stmt.span, detail=f"split axis '{name}' repeats a factor")
                axis = ir.Axis(name, sympy.Mul(*[p.size for p in parts]), tuple(p.name for p in parts),
                               span=stmt.span)
                _check_axis_size(axis)
        self.axes[name] = axis
        return axis

    def _axis_list(self, idents: Sequence[ast.Ident]) -> tuple[str, ...]:
        seen: set[str] = set()
        for ident in idents:
            if ident.name not in self.axes:
                raise UnknownAxis(ident.span, name=ident.name, choices=self.axes)
            if ident.name in seen:
                raise AxisMismatch(ident.span, detail=f"axis '{ident.name}' appears twice in one axis list",
                                   hint="to pair a wire with itself, declare a second axis: axis kcol = kdim")
            seen.add(ident.name)
        return tuple(i.name for i in idents)

    def _owner(self, axis: str, among: Iterable[str]) -> str | None:
        """The split axis among `among` of which `axis` is a factor."""
        for other in among:
            if axis in self.axes[other].factors:
                return other
        return None

    def _merge(self, *groups: Sequence[str]) -> tuple[str, ...]:
        """Union by name, first appearance first, factors absorbed into split axes present."""
        merged: list[str] = []
        for group in groups:
            merged.extend(a for a in group if a not in merged)
        return tuple(a for a in merged if self._owner(a, merged) is None)

    # --- constants ------------------------------------------------------------------------------

    def _const(self, name: str, visiting: tuple[str, ...]) -> float:
        if name in self.consts:
            return self.consts[name]
        stmt = self.decls[name][1]
        assert isinstance(stmt, ast.ConstDecl)
        if name in visiting:
            cycle = " -> ".join([*visiting[visiting.index(name):], name])
            raise CyclicDefinition(stmt.name.span, name=name, cycle=cycle)
        node = self._expr(stmt.value, _Scope(scalar_only="a constant"), const_path=(*visiting, name))
        value = self._evaluate(node, f"constant '{name}'")
        self.consts[name] = value
        return value

    def _evaluate(self, node: ir.Node, what: str) -> float:
        try:
            value = float(to_sympy(node, self.axes))
        except (TypeError, ValueError, ZeroDivisionError):
            raise TypeMismatch(node.span, detail=f"{what} must be a number known when the spec compiles",
                               hint="use literals, other constants and size(AXIS) of fixed-size axes") from None
        if not math.isfinite(value):
            raise TypeMismatch(node.span, detail=f"{what} evaluates to {value}")
        return value

    # --- declarations ---------------------------------------------------------------------------

    def _dtype(self, ident: ast.Ident | None) -> str | None:
        if ident is None:
            return None
        if ident.name not in ir.DTYPES:
            raise UnknownDtype(ident.span, name=ident.name, choices=ir.DTYPES)
        return ident.name

    def _declare_tensor(self, stmt: ast.TensorDecl) -> None:
        axes = self._axis_list(stmt.axes or ())
        dtype = self._dtype(stmt.dtype)
        default = None
        if stmt.role in ("in", "param"):
            if stmt.dtype is None:
                raise InvalidStatement(stmt.name.span, detail=f"{stmt.role} '{stmt.name.name}' needs a dtype",
                                       hint=f"write `{stmt.role} {stmt.name.name}[...] : f32`")
            if stmt.value is not None:
                if axes:
                    raise InvalidStatement(stmt.value.span, detail="only scalar inputs take a default value")
                default = self._expr(stmt.value, _Scope(scalar_only="a default value"))
                self._evaluate_if_fixed(default)
        elif stmt.value is None:
            raise InvalidStatement(stmt.span, detail=f"output '{stmt.name.name}' has no definition",
                                   hint=f"write `out {stmt.name.name}[...] = EXPRESSION`")
        self.tensors[stmt.name.name] = ir.Tensor(stmt.name.name, stmt.role, axes, dtype, stmt.span, default)

    def _evaluate_if_fixed(self, node: ir.Node) -> None:
        if all(not isinstance(n, ir.SizeOf) or self.axes[n.axis].fixed for n in ir.walk(node)):
            self._evaluate(node, "a default value")

    # --- definitions ----------------------------------------------------------------------------

    def _defining(self) -> dict[str, ast.Define | ast.TensorDecl]:
        out: dict[str, ast.Define | ast.TensorDecl] = {}
        for stmt in self._flat():
            if isinstance(stmt, ast.Define) or (isinstance(stmt, ast.TensorDecl) and stmt.role == "out"):
                out[stmt.name.name] = stmt
        return out

    def _ordered_definitions(self) -> list[ast.Define | ast.TensorDecl]:
        defining = self._defining()
        graph = nx.DiGraph()
        graph.add_nodes_from(defining)
        for name, stmt in defining.items():
            assert stmt.value is not None
            for used in _referenced_names(stmt.value):
                if used in defining:
                    graph.add_edge(used, name)
        try:
            cycle = nx.find_cycle(graph)
        except nx.NetworkXNoCycle:
            cycle = []
        if cycle:
            names = [u for u, _ in cycle]
            first = min(names, key=lambda n: (defining[n].span.line, defining[n].span.col))
            at = names.index(first)
            path = [*names[at:], *names[:at], first]
            raise CyclicDefinition(defining[first].name.span, name=first, cycle=" -> ".join(path))
        order = nx.lexicographical_topological_sort(graph, key=lambda n: (defining[n].span.line, n))
        return [defining[n] for n in order]

    def _definition(self, stmt: ast.Define | ast.TensorDecl) -> ir.Definition:
        name = stmt.name.name
        declared = self.tensors[name].axes if stmt.axes is not None else None
        assert stmt.value is not None
        scope = _Scope()
        if isinstance(stmt.value, ast.Call) and stmt.value.func.name == "scan":
            if declared is None:
                raise InvalidStatement(stmt.name.span, detail=f"'{name}' is a scan: declare its axes",
                                       hint=f"write `{name}[AXES] = scan(...)`; `prev` carries those axes")
            scope.scan_axes = declared
        value = self._expr(stmt.value, scope)
        if _is_boolean(value):
            what = "a comparison" if _is_comparison(value) else "a condition"
            raise TypeMismatch(stmt.value.span, detail=f"'{name}' is {what} (true/false)",
                               hint="use it inside where(COND, A, B) or as normalize's mask")
        if declared is None:
            declared = value.axes
        else:
            self._check_cover(declared, value.axes, stmt.value.span, name)
        tensor = self.tensors[name]
        self.tensors[name] = replace(tensor, axes=declared)
        return ir.Definition(name, value, stmt.span)

    def _check_cover(self, declared: Sequence[str], inferred: Sequence[str], span: Span, name: str) -> None:
        for axis in inferred:
            if axis not in declared and self._owner(axis, declared) is None:
                raise AxisMismatch(
                    span,
                    detail=f"the expression for '{name}' carries axis '{axis}', which [{' '.join(declared)}] lacks",
                    hint=f"reduce it (sum(..., over {axis}), or contract over it), or add it to the axis list",
                )
        for axis in declared:
            factors = self.axes[axis].factors
            if axis not in inferred and not (factors and all(f in inferred for f in factors)):
                raise AxisMismatch(
                    span, detail=f"'{name}' declares axis '{axis}' but its expression has only [{' '.join(inferred)}]",
                    hint="remove the axis from the list, or use a tensor that carries it",
                )

    def _check_outputs_and_usage(self) -> None:
        outputs = [t for t in self.tensors.values() if t.role == "out"]
        if not outputs:
            spec = self._stmts(ast.SpecName)  # point at the spec's name, else at the top of the file
            span = spec[0].span if spec else Span(self.module.source.filename, 1, 1, 1, 2)
            raise InvalidStatement(span, detail="the spec declares no output",
                                   hint="add a line `out NAME[AXES] = EXPRESSION`")
        for t in self.tensors.values():
            if t.role in ("in", "param") and t.name not in self.used:
                kind = "input" if t.role == "in" else "parameter"
                self.warnings.append(UnusedInput(t.span, kind=kind, name=t.name))

    # --- bases ----------------------------------------------------------------------------------

    def _basis(self, stmt: ast.BasisDecl) -> ir.Basis:
        check_identifier(stmt.param)
        initial: dict[int, ir.Node] = {}
        step: ir.Node | None = None
        step_var = ""
        for rule in stmt.rules:
            if rule.name.name != stmt.name.name:
                raise InvalidStatement(rule.name.span,
                                       detail=f"rule defines '{rule.name.name}' inside basis '{stmt.name.name}'")
            scope = _Scope(variables={stmt.param.name: None}, scalar_only=f"basis '{stmt.name.name}'")
            if isinstance(rule.index, ast.IndexInt):
                if rule.index.value in initial or rule.index.value != len(initial):
                    raise InvalidStatement(rule.index.span, detail="initial terms are numbered 0, 1, 2, ... once each")
                initial[rule.index.value] = self._expr(rule.value, scope)
            else:
                if step is not None:
                    raise InvalidStatement(rule.span, detail="a basis has one recurrence rule")
                ident = rule.index.ident
                if not isinstance(rule.index, ast.IndexOffset) or rule.index.offset != 1:
                    raise InvalidStatement(rule.index.span,
                                           detail=f"the recurrence defines {stmt.name.name}[{ident.name}+1]")
                check_identifier(ident)
                step_var = ident.name
                scope = scope.child(basis=stmt.name.name, step_var=step_var)
                scope.variables[step_var] = None
                step = self._expr(rule.value, scope)
        if step is None or not initial:
            raise InvalidStatement(stmt.span, detail=f"basis '{stmt.name.name}' needs initial terms and a recurrence",
                                   hint="for example: T[0] = 1, T[1] = u, T[n+1] = 2*u*T[n] - T[n-1]")
        depth = max((t.back for t in ir.walk(step) if isinstance(t, ir.BasisTerm)), default=-1) + 1
        if depth > len(initial):
            raise InvalidStatement(stmt.span, detail=f"the recurrence reaches {depth} terms back but only "
                                   f"{len(initial)} initial terms are given")
        return ir.Basis(stmt.name.name, stmt.param.name, tuple(initial[i] for i in range(len(initial))),
                        step, step_var, stmt.span)

    # --- expressions ----------------------------------------------------------------------------

    def _expr(self, e: ast.Expr, scope: _Scope, const_path: tuple[str, ...] | None = None) -> ir.Node:
        return _ExprLowering(self, scope, const_path).lower(e)


class _ExprLowering:
    def __init__(self, owner: _Lowering, scope: _Scope, const_path: tuple[str, ...] | None) -> None:
        self.o = owner
        self.scope = scope
        self.const_path = const_path

    def sub(self, e: ast.Expr, scope: _Scope | None = None) -> ir.Node:
        return _ExprLowering(self.o, scope or self.scope, self.const_path).lower(e)

    def lower(self, e: ast.Expr) -> ir.Node:
        method = getattr(self, f"_{type(e).__name__}")
        return method(e)

    def _Number(self, e: ast.Number) -> ir.Node:
        return ir.Const(float(e.value), e.span)

    def _NameRef(self, e: ast.NameRef) -> ir.Node:
        name, scope = e.name, self.scope
        if name in scope.variables:
            return ir.Var(name, e.span)
        if name == "prev" and scope.prev_axes is not None:
            return ir.Prev(scope.prev_axes, e.span)
        kind = self.o.decls.get(name, ("",))[0]
        if kind == "const":
            if self.const_path is not None:
                return ir.Const(self.o._const(name, self.const_path), e.span, name)
            return ir.Const(self.o.consts[name], e.span, name)
        if kind == "axis":
            if scope.scalar_only:
                raise TypeMismatch(e.span, detail=f"axis '{name}' cannot be used in {scope.scalar_only}",
                                   hint=f"for its size write size({name})")
            return ir.AxisIndex(name, e.span)
        if kind == "tensor" and name in self.o.tensors:
            return self._load(name, None, e.span)
        if kind == "basis":
            raise TypeMismatch(e.span, detail=f"basis '{name}' is evaluated as {name}[DEGREE](ARG)")
        if name == "prev":
            raise InvalidStatement(e.span, detail="`prev` is only meaningful inside scan(..., over AXIS)")
        choices = [n for n, (k, _) in self.o.decls.items() if k in ("tensor", "const", "axis")]
        raise UnknownName(e.span, name=name, choices=[*choices, *scope.variables])

    def _load(self, name: str, indices: Sequence[ast.Index] | None, span: Span) -> ir.Node:
        if self.scope.scalar_only:
            raise TypeMismatch(span, detail=f"tensor '{name}' cannot be used in {self.scope.scalar_only}",
                               hint="only parameters of the function, constants and numbers are allowed there")
        tensor = self.o.tensors[name]
        self.o.used.add(name)
        if indices is None:
            return ir.Load(name, tuple(ir.LoadIndex(a) for a in tensor.axes), tensor.axes, span)
        if len(indices) != len(tensor.axes):
            raise RankMismatch(span, name=name, expected=len(tensor.axes), axes=" ".join(tensor.axes),
                               got=len(indices))
        out: list[ir.LoadIndex] = []
        for index, axis_name in zip(indices, tensor.axes, strict=True):
            axis = self.o.axes[axis_name]
            if isinstance(index, ast.IndexName) and index.ident.name not in self.scope.variables:
                target = index.ident.name
                if target not in self.o.axes:
                    raise UnknownName(index.span, name=target, choices=[*self.o.axes, *self.scope.variables])
                if target != axis_name and sympy.simplify(self.o.axes[target].size - axis.size) != 0:
                    raise SizeMismatch(index.span, detail=f"'{name}' axis '{axis_name}' (size {axis.size}) "
                                       f"cannot be read as '{target}' (size {self.o.axes[target].size})")
                out.append(ir.LoadIndex(target))
                continue
            if isinstance(index, ast.IndexExpr) or (isinstance(index, ast.IndexOffset)
                                                    and index.ident.name not in self.scope.variables):
                out.append(ir.LoadIndex(None, lower_index(self, index, name, axis)))  # ncd/index_expr.py
                continue
            value, lo, hi = self._index_value(index)
            if axis.fixed is None:
                raise SizeMismatch(index.span, detail=f"axis '{axis_name}' of '{name}' has no fixed size; "
                                   "indexing it with a number or loop variable needs one")
            if lo < 0 or hi >= axis.fixed:
                raise IndexOutOfRange(index.span, index=str(value), name=name, value=lo if lo < 0 else hi,
                                      axis=axis_name, size=axis.fixed)
            out.append(ir.LoadIndex(None, value))
        axes = tuple(i.axis for i in out if i.axis is not None)
        if len(set(axes)) != len(axes):
            raise AxisMismatch(span, detail=f"'{name}' is read with a repeated axis")
        return ir.Load(name, tuple(out), load_axes(out, list(self.o.axes)), span)

    def _index_value(self, index: ast.Index) -> tuple[sympy.Expr, int, int]:
        if isinstance(index, ast.IndexExpr):
            raise TypeMismatch(index.span, detail="a basis degree is a number or a sum index (j, j+1, j-1)")
        if isinstance(index, ast.IndexInt):
            return sympy.Integer(index.value), index.value, index.value
        ident = index.ident
        offset = index.offset if isinstance(index, ast.IndexOffset) else 0
        if ident.name not in self.scope.variables:
            raise UnknownName(ident.span, name=ident.name, choices=self.scope.variables)
        bounds = self.scope.variables[ident.name]
        if bounds is None:
            raise TypeMismatch(ident.span, detail=f"'{ident.name}' cannot index a tensor here")
        return sympy.Symbol(ident.name, integer=True) + offset, bounds[0] + offset, bounds[1] + offset

    def _Indexed(self, e: ast.Indexed) -> ir.Node:
        name = e.name.name
        if self.scope.basis is not None and name == self.scope.basis:
            if len(e.indices) != 1:
                raise RankMismatch(e.span, name=name, expected=1, axes="degree", got=len(e.indices))
            index = e.indices[0]
            step = self.scope.step_var
            if isinstance(index, ast.IndexName) and index.ident.name == step:
                return ir.BasisTerm(0, e.span)
            if isinstance(index, ast.IndexOffset) and index.ident.name == step and index.offset < 0:
                return ir.BasisTerm(-index.offset, e.span)
            raise InvalidStatement(index.span, detail=f"a recurrence reads {name}[{step}], {name}[{step}-1], ...")
        kind = self.o.decls.get(name, ("",))[0]
        if kind == "tensor" and name in self.o.tensors:
            return self._load(name, e.indices, e.span)
        if kind == "basis":
            raise TypeMismatch(e.span, detail=f"basis '{name}' needs an argument: {name}[DEGREE](ARG)")
        if kind in ("const", "axis") or name in self.scope.variables:
            raise TypeMismatch(e.name.span, detail=f"'{name}' is a {kind or 'variable'} and cannot be indexed")
        raise UnknownName(e.name.span, name=name, choices=[n for n, (k, _) in self.o.decls.items() if k == "tensor"])

    def _BasisEval(self, e: ast.BasisEval) -> ir.Node:
        name = e.basis.name
        if self.o.decls.get(name, ("",))[0] != "basis":
            raise UnknownName(e.basis.span, name=name, choices=self.o.bases)
        if len(e.index) != 1:
            raise RankMismatch(e.span, name=name, expected=1, axes="degree", got=len(e.index))
        arg = self.sub(e.arg)
        index = e.index[0]
        if isinstance(index, ast.IndexName) and index.ident.name in self.o.axes:
            axis = self.o.axes[index.ident.name]
            if axis.fixed is None:
                raise SizeMismatch(index.span, detail=f"degree axis '{axis.name}' needs a fixed size")
            return ir.BasisEval(name, axis.name, arg, self.o._merge(arg.axes, (axis.name,)), e.span)
        value, lo, _ = self._index_value(index)
        if lo < 0:
            raise IndexOutOfRange(index.span, index=str(value), name=name, value=lo, axis="degree", size="any")
        return ir.BasisEval(name, value, arg, arg.axes, e.span)

    def _Neg(self, e: ast.Neg) -> ir.Node:
        arg = self._numeric(self.sub(e.operand))
        return ir.Unary("neg", arg, arg.axes, e.span)

    def _Binary(self, e: ast.Binary) -> ir.Node:
        lhs, rhs = self.sub(e.lhs), self.sub(e.rhs)
        if e.op in ir.LOGICAL:
            self._condition(lhs, f"'{e.op}'")
            self._condition(rhs, f"'{e.op}'")
            return ir.Binary(e.op, lhs, rhs, self.o._merge(lhs.axes, rhs.axes), e.span)
        if e.op == "^":
            return self._pow(self._numeric(lhs), rhs, e)
        self._numeric(lhs)
        self._numeric(rhs)
        return ir.Binary(e.op, lhs, rhs, self.o._merge(lhs.axes, rhs.axes), e.span)

    def _pow(self, base: ir.Node, exponent: ir.Node, e: ast.Binary) -> ir.Node:
        # integer variables only: finite-sum indices and a basis recurrence's step variable
        real_vars = [n for n in ir.walk(exponent) if isinstance(n, ir.Var)
                     and self.scope.variables.get(n.name) is None and n.name != self.scope.step_var]
        try:
            raw = to_sympy(exponent, self.o.axes)
            value = None if raw.is_number and abs(raw) > MAX_EXPONENT else sympy.nsimplify(raw)
        except TypeError:
            value = None
        if value is None or real_vars or exponent.axes or not value.is_integer:
            raise TypeMismatch(e.rhs.span, detail="a power's exponent must be an integer known at compile time",
                               hint=f"use an integer of at most {MAX_EXPONENT} in size, a constant or a sum "
                                    "index; exp(y * log(x)) for others")
        try:
            number = to_sympy(base, self.o.axes)
        except TypeError:
            number = None
        if (isinstance(number, sympy.Rational) and value.is_Integer and number not in (0, 1, -1)
                and abs(int(value)) * (number.p.bit_length() + number.q.bit_length()) > MAX_POWER_BITS):
            raise TypeMismatch(e.span, detail="this power of a number is too large to compute")
        return ir.Pow(base, value, base.axes, e.span)

    def _Not(self, e: ast.Not) -> ir.Node:
        arg = self._condition(self.sub(e.operand), "'not'")
        return ir.Unary("not", arg, arg.axes, e.span)

    def _condition(self, node: ir.Node, user: str) -> ir.Node:
        """`node` where a condition is required (an operand of and/or/not): a comparison or and/or/not."""
        if not _is_boolean(node):
            raise TypeMismatch(node.span, detail=f"{user} combines conditions (comparisons, and/or/not), "
                               "not numbers", hint=CONDITION_HINT)
        return node

    def _numeric(self, node: ir.Node) -> ir.Node:
        if _is_boolean(node):
            what = "a comparison" if _is_comparison(node) else "a condition (and/or/not)"
            raise TypeMismatch(node.span, detail=f"{what} cannot be used as a number",
                               hint="write where(COND, 1, 0)")
        return node

    def _Contract(self, e: ast.Contract) -> ir.Node:
        lhs, rhs = self._numeric(self.sub(e.lhs)), self._numeric(self.sub(e.rhs))
        over = self.o._axis_list(e.over)
        for axis, ident in zip(over, e.over, strict=True):
            for side, operand in (("left", lhs), ("right", rhs)):
                if axis not in operand.axes:
                    raise ContractionAxisMissing(ident.span, axis=axis, side=side, axes=" ".join(operand.axes))
        merged = self.o._merge(lhs.axes, rhs.axes)
        return ir.Contract(lhs, rhs, over, tuple(a for a in merged if a not in over), e.span)

    # --- calls ----------------------------------------------------------------------------------

    def _Call(self, e: ast.Call) -> ir.Node:
        fn = e.func.name
        if fn not in FUNCTIONS:
            raise UnknownFunction(e.func.span, name=fn, choices=FUNCTIONS)
        args = _CallArgs(e)
        if fn in ir.ELEMENTWISE:
            args.only(positional=1)
            arg = self._numeric(self.sub(args.positional[0]))
            return ir.Unary(fn, arg, arg.axes, e.span)
        return getattr(self, f"_call_{fn}")(e, args)

    def _call_where(self, e: ast.Call, args: _CallArgs) -> ir.Node:
        args.only(positional=3)
        cond, then, other = (self.sub(a) for a in args.positional)
        if not _is_boolean(cond):
            raise TypeMismatch(cond.span, detail="where()'s first argument must be a comparison (or and/or/not of "
                               "comparisons)", hint=f"{CONDITION_HINT}; where(x != 0, a, b) tests a number")
        return ir.Where(cond, self._numeric(then), self._numeric(other),
                        self.o._merge(cond.axes, then.axes, other.axes), e.span)

    def _call_size(self, e: ast.Call, args: _CallArgs) -> ir.Node:
        args.only(positional=1)
        target = args.positional[0]
        if not isinstance(target, ast.NameRef) or target.name not in self.o.axes:
            raise BadArgument(target.span, name="size", detail="the argument must be an axis name")
        return ir.SizeOf(target.name, e.span)

    def _reduce(self, op: str, e: ast.Call, args: _CallArgs) -> ir.Node:
        if args.comprehension is not None:
            if op != "sum":
                raise BadArgument(e.span, name=op, detail="only sum() takes `for VAR in RANGE`")
            args.only(comprehension=True)
            return self._finite_sum(args.comprehension, e.span)
        if args.over is None:
            if op in ("max", "min") and len(args.positional) == 2:
                args.only(positional=2)
                lhs, rhs = (self._numeric(self.sub(a)) for a in args.positional)
                return ir.Binary(op, lhs, rhs, self.o._merge(lhs.axes, rhs.axes), e.span)
            raise ArityError(e.span, name=op, expected="(X, over AXES)" + (" or (A, B)" if op != "sum" else
                             " or (BODY for VAR in RANGE)"), got=args.describe())
        args.only(positional=1, over=True)
        if op == "min":
            raise BadArgument(e.span, name=op, detail="reductions are sum and max; write -max(-x, over ...)")
        arg = self._numeric(self.sub(args.positional[0]))
        over = self.o._axis_list(args.over.axes)
        for axis, ident in zip(over, args.over.axes, strict=True):
            if axis not in arg.axes:
                raise AxisMismatch(ident.span, detail=f"cannot reduce over '{axis}': the argument has axes "
                                   f"[{' '.join(arg.axes)}]")
        return ir.Reduce(op, over, arg, tuple(a for a in arg.axes if a not in over), e.span)

    def _call_sum(self, e: ast.Call, args: _CallArgs) -> ir.Node:
        return self._reduce("sum", e, args)

    def _call_max(self, e: ast.Call, args: _CallArgs) -> ir.Node:
        return self._reduce("max", e, args)

    def _call_min(self, e: ast.Call, args: _CallArgs) -> ir.Node:
        return self._reduce("min", e, args)

    def _call_clamp(self, e: ast.Call, args: _CallArgs) -> ir.Node:
        """clamp(x, lo, hi) = min(max(x, lo), hi), element-wise (in an index too: ncd/index_expr.py)."""
        args.only(positional=3)
        x, lo, hi = (self._numeric(self.sub(a)) for a in args.positional)
        low = ir.Binary("max", x, lo, self.o._merge(x.axes, lo.axes), e.span)
        return ir.Binary("min", low, hi, self.o._merge(low.axes, hi.axes), e.span)

    def _finite_sum(self, comp: ast.Comprehension, span: Span) -> ir.Node:
        var = comp.var
        check_identifier(var)
        if var.name in self.o.decls or var.name in self.scope.variables:
            kind, line = "an enclosing sum index", var.span.line
            if var.name in self.o.decls:
                kind, line = self.o.decls[var.name][0], self.o.decls[var.name][1].span.line
            raise DuplicateName(var.span, name=var.name, kind=kind, line=line,
                                hint="pick a sum index that is not already a name")
        if isinstance(comp.range, ast.AxisRange):
            ident = comp.range.axis
            if ident.name not in self.o.axes:
                raise UnknownAxis(ident.span, name=ident.name, choices=self.o.axes)
            fixed = self.o.axes[ident.name].fixed
            if fixed is None:
                raise SizeMismatch(ident.span, detail=f"axis '{ident.name}' has no fixed size to sum over")
            lo, hi = 0, fixed - 1
        else:
            lo, hi = self._bound(comp.range.lo), self._bound(comp.range.hi)
            if hi < lo:
                raise BadArgument(comp.range.span, name="sum", detail=f"empty range {lo}..{hi}")
        terms = (hi - lo + 1) * math.prod(b - a + 1 for a, b in filter(None, self.scope.variables.values()))
        if terms > MAX_SUM_TERMS:
            raise LimitExceeded(comp.range.span, detail=f"this sum has {terms} terms (nested sums multiplied); the "
                                f"compiler unrolls sums of at most {MAX_SUM_TERMS}",
                                hint="sum over an axis with sum(x, over AXIS), or contract with `. over`")
        scope = self.scope.child()
        scope.variables[var.name] = (lo, hi)
        body = self._numeric(self.sub(comp.body, scope))
        return ir.FiniteSum(var.name, lo, hi, body, body.axes, span)

    def _bound(self, bound: int | ast.Ident) -> int:
        if isinstance(bound, int):
            return bound
        if self.o.decls.get(bound.name, ("",))[0] == "const":
            # inside a constant's value another constant may not be evaluated yet, or be this very one
            value = self.o._const(bound.name, self.const_path if self.const_path is not None else ())
            if value == int(value):
                return int(value)
        raise TypeMismatch(bound.span, detail=f"range bound '{bound.name}' must be an integer constant")

    def _call_normalize(self, e: ast.Call, args: _CallArgs) -> ir.Node:
        args.only(positional=1, over=True, functions=("a1", "a2", "b"), keywords=("mask", "weight", "sink"))
        if args.over is None or len(args.over.axes) != 1:
            raise BadArgument(e.span, name="normalize", detail="normalize takes exactly one axis: over AXIS")
        arg = self._numeric(self.sub(args.positional[0]))
        over = self.o._axis_list(args.over.axes)[0]
        if over not in arg.axes:
            raise AxisMismatch(args.over.axes[0].span, detail=f"cannot normalize over '{over}': the argument "
                               f"has axes [{' '.join(arg.axes)}]")
        fns = {}
        for key in ("a1", "a2", "b"):
            if key not in args.functions:
                raise BadArgument(e.span, name="normalize", detail=f"missing {key}(x) = ...",
                                  hint="normalize(S, over key, a1(x) = ..., a2(x) = ..., b(z) = ...)")
            f = args.functions[key]
            check_identifier(f.param)
            body = self._numeric(self.sub(f.body, _Scope(variables={f.param.name: None},
                                                         scalar_only=f"inline function {key}")))
            fns[key] = ir.Lambda(f.param.name, body, f.span)
        extras: dict[str, ir.Node | None] = {"mask": None, "weight": None}
        for key in extras:
            if key in args.keywords:
                node = self.sub(args.keywords[key].value)
                if (key == "mask") != _is_boolean(node):
                    want = ("a comparison such as key <= query (or and/or/not of comparisons)" if key == "mask"
                            else "a number")
                    raise TypeMismatch(node.span, detail=f"normalize's {key} must be {want}")
                for axis in node.axes:
                    if axis not in arg.axes and self.o._owner(axis, arg.axes) is None:
                        raise AxisMismatch(node.span, detail=f"normalize's {key} carries axis '{axis}', "
                                           f"which the argument [{' '.join(arg.axes)}] lacks")
                extras[key] = node
        sink = None
        if "sink" in args.keywords:  # a logit per row: one more entry of the normalised axis, with no value
            sink = self._numeric(self.sub(args.keywords["sink"].value))
            for axis in sink.axes:
                if axis == over or (axis not in arg.axes and self.o._owner(axis, arg.axes) is None):
                    raise AxisMismatch(sink.span, detail=f"normalize's sink carries axis '{axis}'; a sink is one "
                                       f"logit per row, over the argument's axes other than '{over}'")
        return ir.Normalize(arg, over, fns["a1"], fns["a2"], fns["b"], extras["mask"], extras["weight"],
                            arg.axes, e.span, sink)

    def _call_scan(self, e: ast.Call, args: _CallArgs) -> ir.Node:
        args.only(positional=1, over=True, keywords=("init",))
        prev_axes = self.scope.scan_axes
        if prev_axes is None:
            raise InvalidStatement(e.span, detail="scan(...) must be the whole right-hand side of a definition")
        if args.over is None or len(args.over.axes) != 1:
            raise BadArgument(e.span, name="scan", detail="scan runs over exactly one axis: over AXIS")
        over = self.o._axis_list(args.over.axes)[0]
        if over not in prev_axes:
            raise AxisMismatch(args.over.axes[0].span, detail=f"scan axis '{over}' is not among the declared "
                               f"axes [{' '.join(prev_axes)}]")
        body = self._numeric(self.sub(args.positional[0], self.scope.child(scan_axes=None, prev_axes=prev_axes)))
        init = None
        if "init" in args.keywords:
            init = self._numeric(self.sub(args.keywords["init"].value, self.scope.child(scan_axes=None)))
            if over in init.axes:
                raise AxisMismatch(init.span, detail=f"scan's init must not carry the scan axis '{over}'")
        if not any(isinstance(n, ir.Prev) for n in ir.walk(body)):
            raise BadArgument(e.span, name="scan", detail="the body never reads `prev`; it is not a recurrence")
        return ir.Scan(over, body, init, self.o._merge(prev_axes, body.axes), e.span)

    def _call_chebyshev_solve(self, e: ast.Call, args: _CallArgs) -> ir.Node:
        args.only(positional=2, over=True, keywords=("iterations", "mu", "L"))
        matrix, rhs = (self._numeric(self.sub(a)) for a in args.positional)
        if args.over is None or len(args.over.axes) != 1:
            raise BadArgument(e.span, name="chebyshev_solve", detail="give the solved axis: over AXIS")
        over = self.o._axis_list(args.over.axes)[0]
        if over not in matrix.axes or over in rhs.axes:
            raise AxisMismatch(args.over.axes[0].span, detail=f"the matrix must carry '{over}' and the "
                               "right-hand side must not")
        size = self.o.axes[over].size
        rows = [a for a in matrix.axes
                if a != over and a in rhs.axes and sympy.simplify(self.o.axes[a].size - size) == 0]
        if len(rows) != 1:
            raise AxisMismatch(e.span, detail=f"cannot tell the matrix's row axis (candidates: {rows or 'none'})",
                               hint=f"the right-hand side must carry exactly one axis of '{over}''s size")
        row = rows[0]
        for key in ("iterations", "mu", "L"):
            if key not in args.keywords:
                raise BadArgument(e.span, name="chebyshev_solve", detail=f"missing {key} = ...")
        iterations = self.o._evaluate(self.sub(args.keywords["iterations"].value), "iterations")
        if iterations != int(iterations) or iterations < 1:
            raise BadArgument(args.keywords["iterations"].span, name="chebyshev_solve",
                              detail="iterations must be a positive integer")
        mu, lip = (self._numeric(self.sub(args.keywords[k].value)) for k in ("mu", "L"))
        axes = tuple(over if a == row else a for a in rhs.axes)
        for node in (mu, lip):
            if any(a not in axes for a in node.axes):
                raise AxisMismatch(node.span, detail="mu and L must be scalars per right-hand side")
        return ir.ChebyshevSolve(matrix, rhs, row, over, int(iterations), mu, lip, axes, e.span)


class _CallArgs:
    """A call's arguments sorted by form, with checks that say which form was unexpected."""

    def __init__(self, call: ast.Call) -> None:
        self.call = call
        self.positional: list[ast.Expr] = []
        self.over: ast.OverArg | None = None
        self.keywords: dict[str, ast.KeywordArg] = {}
        self.functions: dict[str, ast.FunctionArg] = {}
        self.comprehension: ast.Comprehension | None = None
        for arg in call.args:
            if isinstance(arg, ast.OverArg):
                if self.over is not None:
                    raise BadArgument(arg.span, name=call.func.name, detail="`over` given twice")
                self.over = arg
            elif isinstance(arg, ast.KeywordArg | ast.FunctionArg):
                table = self.keywords if isinstance(arg, ast.KeywordArg) else self.functions
                if arg.name.name in self.keywords or arg.name.name in self.functions:
                    raise BadArgument(arg.span, name=call.func.name, detail=f"'{arg.name.name}' given twice")
                table[arg.name.name] = arg  # type: ignore[assignment]
            elif isinstance(arg, ast.Comprehension):
                self.comprehension = arg
            else:
                self.positional.append(arg)

    def describe(self) -> str:
        parts = [f"{len(self.positional)} positional"]
        if self.over:
            parts.append("over")
        parts += [f"{k}=" for k in self.keywords] + [f"{k}(..)=" for k in self.functions]
        return ", ".join(parts)

    def only(self, positional: int = 0, over: bool = False, keywords: Sequence[str] = (),
             functions: Sequence[str] = (), comprehension: bool = False) -> None:
        name = self.call.func.name
        if len(self.positional) != positional:
            expected = f"{positional} positional argument" + ("s" if positional != 1 else "")
            raise ArityError(self.call.span, name=name, expected=expected, got=self.describe())
        if self.over is not None and not over:
            raise BadArgument(self.over.span, name=name, detail="takes no `over` clause")
        for table, allowed in ((self.keywords, keywords), (self.functions, functions)):
            for key, arg in table.items():
                if key not in allowed:
                    what = ", ".join(allowed) if allowed else "none"
                    raise BadArgument(arg.span, name=name, detail=f"unexpected argument '{key}' (accepted: {what})")
        if self.comprehension is not None and not comprehension:
            raise BadArgument(self.comprehension.span, name=name, detail="takes no `for` clause")


def _check_axis_size(axis: ir.Axis) -> None:
    if axis.fixed is not None and axis.fixed > MAX_AXIS_SIZE:
        size = axis.fixed if axis.fixed < 10**30 else f"10^{len(str(axis.fixed)) - 1} or more"
        raise LimitExceeded(axis.span, detail=f"axis '{axis.name}' has size {size}, more than the "
                            f"{MAX_AXIS_SIZE} (2^31 - 1) the compiler allows",
                            hint="kernels index with 32-bit integers; declare a smaller size")


def _is_boolean(node: ir.Node) -> bool:
    """Whether `node` is a condition: a comparison, and/or of conditions, not of a condition."""
    return isinstance(node, ir.Binary | ir.Unary) and node.boolean


def _is_comparison(node: ir.Node) -> bool:
    return isinstance(node, ir.Binary) and node.op in ir.COMPARISONS


def _referenced_names(e: object) -> set[str]:
    """Every name an AST subtree mentions (tensor references are among them), less the names an inline function's
    parameter or a finite sum's index binds inside it (`b(z) = z` reads no tensor `z`: variables come first)."""
    out: set[str] = set()
    stack = [e]
    while stack:
        item = stack.pop()
        if isinstance(item, ast.NameRef):
            out.add(item.name)
        elif isinstance(item, ast.Indexed):
            out.add(item.name.name)
        if isinstance(item, ast.FunctionArg | ast.Comprehension):
            bound = item.param.name if isinstance(item, ast.FunctionArg) else item.var.name
            body = item.body
            out |= _referenced_names(body) - {bound}
            if isinstance(item, ast.Comprehension):
                stack.append(item.range)
            continue
        if hasattr(item, "__dataclass_fields__"):
            stack.extend(getattr(item, f) for f in item.__dataclass_fields__)
        elif isinstance(item, tuple):
            stack.extend(item)
    return out
