"""The generic family: every verified IR program becomes a PyTorch function (ncd/families/generic/emit.py) that
torch.compile lowers to Triton through Inductor on CUDA tensors, with its backward from autograd.

It is asked last: specialised families (attention, rational, polykan, recurrence) claim the specs they have
hand-built kernels for; every other spec compiles here, or is rejected with the location of what the generic
family cannot honour: a normalize whose exponentials no max subtraction stabilises, a division by (or log of) a
spelled-out sum of unbounded exponentials, an axis whose size no argument gives, a scan over a split axis or one
that reduces over its own axis."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import sympy
import torch

from ... import ir
from ...errors import InvalidIdentifier
from ...pipeline import FrontEnd
from ...source import origin_name
from .emit import BodyEmitter, Stabilised, Value

FAMILY = "generic"
# Odd sizes, distinct so that two axes confused with each other give a shape error, none a power of two.
VALIDATION_SIZES = (7, 5, 9, 11, 13, 3, 15, 17)


@dataclass(frozen=True)
class GenericPlan:
    family: str
    program_name: str
    origin: str  # the spec's file name as generated code shows it (origin_name)
    outputs: tuple[str, ...]
    body: tuple[str, ...]  # the op body's lines, each with its `# spec.ncd:LINE` origin
    body_args: tuple[str, ...]  # tensor inputs, parameters, scalar inputs
    stabilised: tuple[Stabilised, ...]
    solves: bool  # the module defines _ImplicitSolve (chebyshev_solve)
    declined: tuple[tuple[str, str], ...] = field(default=())  # (family, "file:line:col: reason"), from the registry
    constants: frozenset[str] = field(default=frozenset())  # integer and boolean inputs: they take no gradient

    @property
    def output(self) -> str:
        return "+".join(self.outputs)

    def describe(self, declined: tuple[tuple[str, str], ...] | None = None) -> list[str]:
        lines = [f"family: {FAMILY}",
                 f"  op: a PyTorch function built from the IR, node by node (outputs {', '.join(self.outputs)}); "
                 "backward: PyTorch autograd",
                 "  compiled: torch.compile (Inductor -> Triton) on CUDA tensors, eager elsewhere "
                 "(NCD_GENERIC_COMPILE = cuda | always | never; the module's COMPILE)",
                 "  precision: inputs upcast to float32, outputs in the inputs' dtype"]
        lines += [f"  stabilised: {s.span.origin}:{s.span.col}: {s.how}" for s in self.stabilised]
        lines += [f"  declined by {name}: {reason}" for name, reason in (self.declined if declined is None
                                                                         else declined)]
        return lines

    def render(self, program: ir.Program, op_id: str) -> str:
        from .render import render_module

        return render_module(self, program, op_id)

    def validation_sizes(self, program: ir.Program) -> dict[str, int]:
        return validation_sizes(program)

    def constant_inputs(self) -> frozenset[str]:
        return self.constants


def validation_sizes(program: ir.Program) -> dict[str, int]:
    """Every call-time size symbol gets its own small odd value; split and alias axes follow from theirs."""
    symbols = sorted({s for a in program.axes for s in a.size.free_symbols}, key=lambda s: s.name)
    values = {s: VALIDATION_SIZES[i % len(VALIDATION_SIZES)] for i, s in enumerate(symbols)}
    return {a.name: int(sympy.sympify(a.size).subs(values)) for a in program.axes}


def size_sources(program: ir.Program) -> dict[str, str]:
    """Call-time axis -> the expression of its size inside the body, from the tensor arguments' shapes (so that
    Inductor sees the sizes agree): an axis a tensor carries, an alias or split axis through its size symbols, and
    the one free factor of a carried split axis by division (bind_axes has checked that it divides). Axes whose size
    no argument gives are left out (the emitter rejects a use of one)."""
    carried: dict[str, str] = {}
    for t in (*program.inputs, *program.params):
        for i, name in enumerate(t.axes):
            carried.setdefault(name, f"{t.name}.shape[{i}]")
    symbols: dict[sympy.Symbol, str] = {}
    for name, code in carried.items():
        size = program.axis(name).size
        if isinstance(size, sympy.Symbol):
            symbols.setdefault(size, code)
    for axis in program.axes:  # a carried split axis with one factor of unknown size: that factor by division
        if axis.name in carried and axis.factors:
            unknown = [f for f in axis.factors if program.axis(f).size.free_symbols - symbols.keys()]
            if len(unknown) == 1 and isinstance(program.axis(unknown[0]).size, sympy.Symbol):
                known = [_size_code(program.axis(f).size, symbols) for f in axis.factors if f != unknown[0]]
                divisor = " * ".join(known) or "1"
                divisor = f"({divisor})" if len(known) > 1 else divisor
                symbols[program.axis(unknown[0]).size] = f"({carried[axis.name]} // {divisor})"
    out = dict(carried)
    for axis in program.axes:
        if axis.fixed is None and axis.name not in out and not axis.size.free_symbols - symbols.keys():
            out[axis.name] = _size_code(axis.size, symbols)
    return out


def _size_code(size: sympy.Expr, symbols: dict[sympy.Symbol, str]) -> str:
    """A size (an integer, a symbol, a product of them) as code, its symbols replaced by their expressions."""
    if size.is_Integer:
        return str(int(size))
    if isinstance(size, sympy.Symbol):
        return symbols[size]
    factors = [term.as_base_exp() for term in sympy.Mul.make_args(size)]
    return "(" + " * ".join(_size_code(base, symbols) for base, exp in factors for _ in range(int(exp))) + ")"


def _check_parameter_names(program: ir.Program) -> None:
    """Parameters become attributes of the generated nn.Module: none may replace one of nn.Module's own."""
    taken = set(dir(torch.nn.Module))
    for t in program.params:
        if t.name in taken:
            raise InvalidIdentifier(t.span, name=t.name, reason="the generated nn.Module holds parameters as "
                                    f"attributes, and nn.Module has its own '{t.name}'", hint="rename the parameter")


def emit_body(program: ir.Program) -> BodyEmitter:
    emitter = BodyEmitter(program, size_sources(program))
    for t in (*program.inputs, *program.params):
        emitter.origin = t.span
        if t.axes or t.role == "param":
            emitter.lines.append(f"{t.name} = {t.name}.to(torch.float32)  # {t.span.origin}")
        else:
            emitter.lines.append(f"if {t.name} is not None:  # {t.span.origin}")
            emitter.lines.append(f"    {t.name} = torch.as_tensor({t.name}, dtype=torch.float32, "
                                 f"device=_device)  # {t.span.origin}")
            if t.default is not None:
                mark, known = len(emitter.lines), dict(emitter.computed)
                value = emitter.as_tensor(emitter.eval(t.default, {}), t.span)
                default = [f"    {line}" for line in emitter.lines[mark:]]
                del emitter.lines[mark:]
                emitter.computed = known  # what the `else:` branch computes exists only there
                emitter.lines += ["else:", *default, f"    {t.name} = {value.code}  # {t.span.origin}"]
        emitter.env[t.name] = Value(t.name, t.axes)
    for d in program.definitions:
        tensor = program.tensor(d.tensor)
        emitter.origin = d.span
        value = emitter.to_axes(emitter.eval(d.value, {}), tensor.axes, "exact", d.span)[0]
        if not value.tensor:
            value = emitter.as_tensor(value, d.span)
        if value.code in {t.name for t in (*program.inputs, *program.params)}:  # never return an input itself
            value = emitter.emit(f"{value.code}.clone()", value.axes, d.span)
        emitter.bind(d.tensor, value, d.span)
        emitter.env[d.tensor] = Value(d.tensor, tensor.axes)
    keep = {t.name for t in (*program.inputs, *program.params, *program.outputs)}
    emitter.lines = unused_lines_dropped(emitter.lines, keep)
    return emitter


def unused_lines_dropped(lines: list[str], keep: set[str]) -> list[str]:
    """The body without top-level assignments nothing later reads (an intermediate a rewrite went around, such as
    the exp(S) of a spelled-out softmax; an unused intermediate): they cannot change the outputs or gradients."""
    lines = list(lines)
    changed = True
    while changed:
        changed = False
        for i in range(len(lines) - 1, -1, -1):
            target = re.match(r"([A-Za-z_]\w*) = ", lines[i])
            if target is None or target.group(1) in keep:
                continue
            read = re.compile(rf"\b{target.group(1)}\b")
            if not any(read.search(line.split("  # ")[0]) for line in lines[i + 1:]):
                del lines[i]
                changed = True
    return lines


def tensor_arguments(program: ir.Program) -> list[str]:
    """The op's positional arguments: tensor inputs, then parameters."""
    return [t.name for t in program.inputs if t.axes] + [t.name for t in program.params]


def scalar_arguments(program: ir.Program) -> list[str]:
    """The op's keyword-only arguments: scalar inputs (a number, or a one-element tensor)."""
    return [t.name for t in program.inputs if not t.axes]


def plan_generic(front: FrontEnd, bindings: dict[str, int]) -> GenericPlan:
    """The generic family claims every verified program, or raises a located error for a node it cannot honour."""
    program = front.program
    _check_parameter_names(program)
    emitter = emit_body(program)
    tensors, scalars = tensor_arguments(program), scalar_arguments(program)
    return GenericPlan(FAMILY, program.name, origin_name(front.source.filename),
                       tuple(t.name for t in program.outputs), tuple(emitter.lines),
                       (*tensors, *scalars), tuple(emitter.stabilised), emitter.solves,
                       constants=frozenset(t.name for t in program.inputs if t.dtype not in ir.FLOAT_DTYPES))
