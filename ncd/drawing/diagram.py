"""A spec's verified IR as a neural circuit diagram: a networkx graph of boxes and labelled wires.

Nodes are the spec's tensors (inputs, parameters, scalar inputs, outputs, intermediate `let`s) and the operations
of its definitions (the IR's expression nodes). An edge is a wire carrying its axes; a tensor read by an operation
is a wire from the tensor's box. Contractions are cups joining their two wires, naming the contracted axes and the
axes the operands share (woven); an elementwise operation marks the axes a wire is broadcast over. With the plan's
marks (`PlanMarks`), the normaliser or scan the family streams names its axis and accumulator state, and the
definitions one kernel computes share a boundary labelled with the family."""

from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx
import sympy

from ncd import ir
from ncd.printer import format_node

# what each kind of box is; render.py styles them
TENSOR_KINDS = ("in", "param", "scalar", "out", "let")
OPERATION_KINDS = ("op", "contract", "normalize", "reduce", "basis", "scan", "solve", "leaf")


@dataclass(frozen=True)
class PlanMarks:
    """What the compiler decided, as the diagram marks it: the family that compiled the spec, the axis it streams
    (or scans) and the accumulator state it keeps there, and the kernels: each a label and the definitions (by
    tensor name) it computes."""

    family: str
    stream_axis: str | None = None
    state: tuple[str, ...] = ()
    kernels: tuple[tuple[str, tuple[str, ...]], ...] = field(default=())


def axes_text(axes: tuple[str, ...], program: ir.Program) -> str:
    """[batch head query dim=128]: an axis of fixed size shows it; no axes: scalar."""
    if not axes:
        return "scalar"
    sizes = {a.name: a.fixed for a in program.axes}
    return "[" + " ".join(f"{a}={sizes[a]}" if sizes.get(a) is not None else a for a in axes) + "]"


def _short(node: ir.Node, limit: int = 28) -> str:
    text = format_node(node)
    return text if len(text) <= limit else text[:limit - 1] + "…"


class _Builder:
    def __init__(self, program: ir.Program, marks: PlanMarks | None) -> None:
        self.program, self.marks = program, marks
        self.graph = nx.DiGraph(name=program.name)
        self.count = 0

    def tensor_id(self, name: str) -> str:
        return f"tensor:{name}"

    def new(self, kind: str, lines: list[str], axes: tuple[str, ...], definition: str, **extra: object) -> str:
        self.count += 1
        node = f"{kind}:{self.count}"
        self.graph.add_node(node, kind=kind, lines=lines, axes=axes, definition=definition, **extra)
        return node

    def wire(self, source: str, target: str, axes: tuple[str, ...], role: str = "",
             broadcast: tuple[str, ...] = ()) -> None:
        self.graph.add_edge(source, target, label=axes_text(axes, self.program), axes=axes, role=role,
                            broadcast=broadcast)

    def tensors(self) -> None:
        for t in self.program.tensors:
            kind = "scalar" if t.role == "in" and not t.axes else t.role
            lines = [t.name, axes_text(t.axes, self.program)] if t.axes else [t.name]
            if t.role == "param":
                lines.append("param")
            self.graph.add_node(self.tensor_id(t.name), kind=kind, lines=lines, axes=t.axes, definition="")

    def definitions(self) -> None:
        for d in self.program.definitions:
            source, axes = self.expr(d.value, d.tensor)
            self.wire(source, self.tensor_id(d.tensor), axes)
            self.graph.nodes[self.tensor_id(d.tensor)]["definition"] = d.tensor

    def child(self, node: ir.Node, parent: str, parent_axes: tuple[str, ...], definition: str, role: str = "",
              elementwise: bool = False) -> None:
        source, axes = self.expr(node, definition)
        broadcast = tuple(a for a in parent_axes if a not in axes) if elementwise and axes else ()
        self.wire(source, parent, axes, role, broadcast)

    def expr(self, node: ir.Node, definition: str) -> tuple[str, tuple[str, ...]]:
        """The box that produces `node`'s wire (added with its inputs), and the wire's axes."""
        if isinstance(node, ir.Load):
            tensor = self.program.tensor(node.tensor)
            if all(i.axis is not None for i in node.index) and tuple(i.axis for i in node.index) == tensor.axes:
                return self.tensor_id(node.tensor), node.axes
            gather = self.new("op", [_short(node)], node.axes, definition)  # read at index expressions
            self.wire(self.tensor_id(node.tensor), gather, tensor.axes, "gather")
            return gather, node.axes
        if isinstance(node, ir.Const | ir.SizeOf | ir.AxisIndex | ir.Var | ir.BasisTerm | ir.Prev):
            text = "previous state" if isinstance(node, ir.Prev) else \
                f"position {node.axis}" if isinstance(node, ir.AxisIndex) else _short(node)
            return self.new("leaf", [text], node.axes, definition), node.axes
        if isinstance(node, ir.Unary):
            box = self.new("op", [node.fn if node.fn != "neg" else "−"], node.axes, definition)
            self.child(node.arg, box, node.axes, definition, elementwise=True)
        elif isinstance(node, ir.Binary):
            box = self.new("op", [node.op], node.axes, definition)
            self.child(node.lhs, box, node.axes, definition, elementwise=True)
            self.child(node.rhs, box, node.axes, definition, elementwise=True)
        elif isinstance(node, ir.Pow):
            box = self.new("op", [f"^{node.exponent}"], node.axes, definition)
            self.child(node.base, box, node.axes, definition, elementwise=True)
        elif isinstance(node, ir.Where):
            box = self.new("op", ["where"], node.axes, definition)
            for role, part in (("cond", node.cond), ("then", node.then), ("else", node.otherwise)):
                self.child(part, box, node.axes, definition, role, elementwise=True)
        elif isinstance(node, ir.FiniteSum):
            box = self.new("op", [f"Σ {node.var} = {node.lo}..{node.hi}", _short(node.body)], node.axes, definition)
            for name in dict.fromkeys(n.tensor for n in ir.walk(node.body) if isinstance(n, ir.Load)):
                self.wire(self.tensor_id(name), box, self.program.tensor(name).axes, "term")
        elif isinstance(node, ir.Reduce):
            box = self.new("reduce", [f"{node.op} over {' '.join(node.over)}"], node.axes, definition)
            self.child(node.arg, box, node.axes, definition)
        elif isinstance(node, ir.Contract):
            shared = [a for a in node.lhs.axes if a in node.rhs.axes and a not in node.over]
            lines = [f"contract over {' '.join(node.over)}"] + ([f"woven: {' '.join(shared)}"] if shared else [])
            box = self.new("contract", lines, node.axes, definition)
            self.child(node.lhs, box, node.axes, definition)
            self.child(node.rhs, box, node.axes, definition)
        elif isinstance(node, ir.Normalize):
            lines = [f"normalize over {node.over}", f"a1({node.a1.param}) = {format_node(node.a1.body)}",
                     f"a2({node.a2.param}) = {format_node(node.a2.body)}",
                     f"b({node.b.param}) = {format_node(node.b.body)}"]
            box = self.new("normalize", lines, node.axes, definition, over=node.over)
            self.child(node.arg, box, node.axes, definition)
            for role, operand in (("mask", node.mask), ("weight", node.weight), ("sink", node.sink)):
                if operand is not None:
                    self.child(operand, box, node.axes, definition, role)
        elif isinstance(node, ir.BasisEval):
            index = node.index if isinstance(node.index, str) else sympy.sstr(node.index)
            box = self.new("basis", [f"basis {node.basis}[{index}](x)", *self.recurrence(node.basis)], node.axes,
                           definition)
            self.child(node.arg, box, node.axes, definition)
        elif isinstance(node, ir.Scan):
            box = self.new("scan", [f"scan over {node.over}"], node.axes, definition, over=node.over)
            self.child(node.body, box, node.axes, definition, "step")
            if node.init is not None:
                self.child(node.init, box, node.axes, definition, "init")
        elif isinstance(node, ir.ChebyshevSolve):
            lines = [f"chebyshev_solve rows {node.row} over {node.over}", f"{node.iterations} steps"]
            box = self.new("solve", lines, node.axes, definition)
            for role, part in (("A", node.matrix), ("b", node.rhs), ("mu", node.mu), ("L", node.lipschitz)):
                self.child(part, box, node.axes, definition, role)
        else:
            raise TypeError(f"no diagram box for {type(node).__name__}")
        return box, node.axes

    def recurrence(self, name: str) -> list[str]:
        """A basis's definition as the box shows it: P[0](x) = ..., then P[n+1](x) from P[n], P[n-1], ..."""
        basis = next((b for b in self.program.bases if b.name == name), None)
        if basis is None:  # a built-in basis: its name says it
            return []
        x = basis.param
        lines = [f"{name}[{k}]({x}) = {format_node(p)}" for k, p in enumerate(basis.initial)]
        step = format_node(basis.step).replace("term[n", f"{name}[{basis.step_var}")
        return [*lines, f"{name}[{basis.step_var}+1]({x}) = {step}"]

    def mark(self) -> None:
        """The plan's marks: the streamed box's axis and state; each kernel's definitions."""
        marks = self.marks
        if marks is None:
            return
        self.graph.graph["family"] = marks.family
        for _, data in self.graph.nodes(data=True):
            if marks.stream_axis is not None and data.get("over") == marks.stream_axis:
                data["lines"] = [*data["lines"], f"streamed over {marks.stream_axis}",
                                 f"state: {', '.join(marks.state)}"]
                data["streamed"] = True
        kernel_of = {name: k for k, (_, names) in enumerate(marks.kernels) for name in names}
        for _, data in self.graph.nodes(data=True):
            if data["kind"] not in TENSOR_KINDS or data["kind"] == "let":
                data["kernel"] = kernel_of.get(data["definition"])
        self.graph.graph["kernels"] = [label for label, _ in marks.kernels]


def diagram(program: ir.Program, marks: PlanMarks | None = None) -> nx.DiGraph:
    """The spec's diagram graph: node attributes kind, lines (the box's text), axes, definition (the tensor whose
    definition it belongs to), and with marks streamed and kernel (an index into graph["kernels"]); edge attributes
    label (the wire's axes), role (which operand: mask, weight, init, ...), broadcast (axes it is broadcast over)."""
    builder = _Builder(program, marks)
    builder.tensors()
    builder.definitions()
    builder.mark()
    builder.graph.graph["axes"] = [(a.name, a.fixed) for a in program.axes]
    return builder.graph
