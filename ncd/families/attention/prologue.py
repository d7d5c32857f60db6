"""Q, K and V transforms as a prologue of the attention op: QK-norm, cosine attention, feature maps.

A score operand (or the value) that the spec computes before the contraction, `Qn[batch head query dim] =
gq * Q / sqrt(sum(Q * Q, over dim) / size(dim) + 1e-6)`, is not read by the kernels from an input: the generated op
computes it first, in PyTorch, and hands the result to the kernels as their q (k, v). The prologue's code is the
generic family's (`ncd/families/generic/emit.py`, `BodyEmitter`): written from the IR node by node with `# spec:LINE`
origins, computed in float32 and handed over in the inputs' dtype. Autograd differentiates it, so the kernels' dq
flows back into Q and into the transform's parameters (gq); the attention custom op itself is unchanged. On CUDA
tensors it runs through torch.compile as the generic family's ops do (the module's PROLOGUE_COMPILE, from
NCD_GENERIC_COMPILE): eagerly, an RMS norm is about ten element-wise kernels over [B, H, N, D], fused by Inductor
into one forward and one backward; inside a caller's torch.compile it is traced with the caller's graph.

What counts as a transform (`transforms`), checked once the roles are known:

- the operand is an intermediate read whole (`Qn`, not an expression inside the contraction), and it and the
  intermediates it reads are computed from `in` tensors, parameters, numbers, sizes and positions only;
- every wire inside carries only the operand's own axes (no key axis for q, no query axis for k), so the transform
  of one token never reads another's row; a reduction or contraction inside reduces only over the operand's
  feature axis (the head dim: RMS and l2 norms are row-wise);
- no normalize, scan or solve inside.

A transform that breaks a rule is a located `unsupported` error: the spec falls to the generic family, and
`--emit plan` says why."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ncd import ir
from ncd.source import Span

# `ncd check`'s tolerance for the gradients of the inputs a prologue reads, in bf16 draws (fp32 keeps the default).
# The kernels read the transform's result rounded to bf16 and round dS to bf16 before dS K (FlashAttention's
# practice); with features of nonzero mean such as elu(x) + 1, dQ = sum_j dS_ij phi(k_j) cancels the mean against
# sum_j dS_ij = 0, so those roundings weigh more. Measured on causal softmax over elu + 1 features (37 x 29, D 40):
# dQ 1.2e-2 at two draws, where eager PyTorch bf16 of the same math (features rounded to bf16, SDPA) measured
# 7.0e-3 to 9.1e-3 over six draws: within the project's 2x of eager bf16, above the default 1e-2.
GRAD_TOLERANCE_LOW_PRECISION = 2e-2
ROLE_AXIS = {"Q": "query", "K": "key", "V": "key"}  # the sequence axis each operand carries (for messages)
NOT_IN_A_PROLOGUE = (ir.Normalize, ir.Scan, ir.Prev, ir.ChebyshevSolve)


@dataclass(frozen=True)
class Transform:
    """One operand of the kernels that the op computes before them."""

    role: str  # "Q", "K" or "V"
    name: str  # the intermediate the kernels read in the operand's place
    axes: tuple[str, ...]  # its declared axes
    definitions: tuple[str, ...]  # the intermediates it computes, in program order (`name` last)
    reads: tuple[str, ...]  # the inputs and parameters it reads, in declaration order
    source: str | None  # the one float `in` tensor over the operand's axes that it transforms (draws change it)
    span: Span  # the definition of `name`
    text: str  # that definition as the spec writes it (for `--emit plan`)

    def describe(self) -> str:
        return f"  prologue (PyTorch before the kernels, autograd): {self.role} <- {self.text}  # {self.span.origin}"


def transformed_operand(program: ir.Program, node: ir.Node) -> ir.Load | None:
    """`node` where it reads an intermediate whole that is not an alias of an input: the candidate for a transform
    (the rules are checked by `transforms`); None where it is anything else."""
    if not isinstance(node, ir.Load) or program.tensor(node.tensor).role != "let":
        return None
    if tuple(i.axis for i in node.index) != program.tensor(node.tensor).axes:
        return None
    inlined = ir.inline(program, node)
    if isinstance(inlined, ir.Load) and program.tensor(inlined.tensor).role == "in":
        return None  # `Qn = Q`: the kernels read Q itself
    return node


def operand(program: ir.Program, node: ir.Node, what: str) -> ir.Load:
    """The load the kernels read for a score operand or the value: an intermediate a prologue computes, or the
    input read directly (plan._load_of_input, which names what the kernels need)."""
    from ncd.families.attention.plan import _load_of_input

    return transformed_operand(program, node) or _load_of_input(program, ir.inline(program, node), what)


def _error(span: Span, detail: str, hint: str) -> Exception:
    from ncd.families.attention.plan import UnsupportedAttention

    return UnsupportedAttention(span, detail=detail, hint=hint)


def transforms(program: ir.Program, operands: Mapping[str, ir.Load], features: Mapping[str, str]
               ) -> tuple[Transform, ...]:
    """A Transform for each operand ("Q", "K", "V" -> its load) that reads an intermediate; `features` gives each
    operand's feature axis (the head dim), the only axis a reduction inside may remove. A located error where a
    transform breaks a rule (module docstring)."""
    out = []
    for role, load in operands.items():
        if program.tensor(load.tensor).role == "let":
            out.append(_transform(program, role, load, features[role]))
    return tuple(out)


def _transform(program: ir.Program, role: str, load: ir.Load, feature: str) -> Transform:
    own = set(load.axes)
    definitions: list[str] = []
    reads: set[str] = set()
    hint = (f"compute {role} from inputs and parameters over [{' '.join(load.axes)}] only (reductions over "
            f"'{feature}'), or make {role} an `in` tensor of the spec")

    def visit(name: str) -> None:
        if name in definitions:
            return
        nodes = list(ir.walk(program.definition(name).value))
        for node in nodes:  # first the wires (a wire over the key axis is the reason, not its reduction)
            extra = [a for a in node.axes if a not in own]
            if extra:
                raise _error(node.span, f"the transform of {role} ('{load.tensor}') reads a wire over "
                             f"'{extra[0]}', which {role} [{' '.join(load.axes)}] lacks: a prologue computes each "
                             f"{ROLE_AXIS[role]} row from that row alone", hint)
        for node in nodes:
            if isinstance(node, NOT_IN_A_PROLOGUE):
                raise _error(node.span, f"the transform of {role} ('{load.tensor}') holds a "
                             f"{type(node).__name__.lower()}; an attention prologue is element-wise with reductions "
                             f"over '{feature}'", hint)
            over = getattr(node, "over", ()) if isinstance(node, ir.Reduce | ir.Contract) else ()
            if any(a != feature for a in over):
                axis = next(a for a in over if a != feature)
                raise _error(node.span, f"the transform of {role} ('{load.tensor}') reduces over '{axis}'; an "
                             f"attention prologue reduces only over the feature axis '{feature}' (row-wise)", hint)
            if isinstance(node, ir.Load):
                tensor = program.tensor(node.tensor)
                if tensor.role == "let":
                    if tuple(i.axis for i in node.index) != tensor.axes:
                        raise _error(node.span, f"the transform of {role} reads '{node.tensor}' relabelled or "
                                     "indexed; a prologue reads its intermediates whole", hint)
                    visit(node.tensor)
                elif tensor.role in ("in", "param"):
                    reads.add(node.tensor)
                else:
                    raise _error(node.span, f"the transform of {role} reads the output '{node.tensor}'", hint)
        definitions.append(name)

    visit(load.tensor)
    order = [t.name for t in program.tensors]
    floats = [t.name for t in program.inputs
              if t.name in reads and t.axes and set(t.axes) == own and t.dtype in ir.FLOAT_DTYPES]
    d = program.definition(load.tensor)
    return Transform(role, load.tensor, program.tensor(load.tensor).axes,
                     tuple(sorted(definitions, key=[x.tensor for x in program.definitions].index)),
                     tuple(sorted(reads, key=order.index)), floats[0] if len(floats) == 1 else None, d.span,
                     _spec_text(program, d.span))


def _spec_text(program: ir.Program, span: Span) -> str:
    """The statement at `span` as written, on one line (continuation lines joined, comments dropped)."""
    lines = [program.source.line(n) for n in range(span.line, span.end_line + 1)]
    lines[-1] = lines[-1][:span.end_col - 1]
    lines[0] = lines[0][span.col - 1:]
    return " ".join(" ".join(line.split("#", 1)[0].rstrip().rstrip("\\").split()) for line in lines)


# --- what `ncd check`'s draws change in place of a transformed operand --------------------------------------------


def by_name(prologue: Sequence[Transform]) -> dict[str, Transform]:
    return {t.name: t for t in prologue}


def drawn_input(prologue: Sequence[Transform], name: str) -> str | None:
    """The input that stands for the kernels' operand `name` in a draw: `name` itself where it is an input, the
    transform's source where a prologue computes it from one, else None (the draw leaves that operand alone)."""
    t = by_name(prologue).get(name)
    return name if t is None else t.source


def scaled_inputs(prologue: Sequence[Transform], names: Sequence[str], program: ir.Program) -> list[str]:
    """The inputs the "large" draw multiplies to make the scores large: each operand that is an input, and for a
    transformed one the float tensors it reads (the source and its gains: a normalised q is scale-free)."""
    out: list[str] = []
    for name in names:
        t = by_name(prologue).get(name)
        picked = [name] if t is None else [n for n in t.reads if program.tensor(n).axes
                                           and program.tensor(n).dtype in ir.FLOAT_DTYPES]
        out += [n for n in picked if n not in out]
    return out


# --- the generated code ------------------------------------------------------------------------------------------


RUNNER = '''

def _prologue(*args):
    """`_prologue_body`, through torch.compile on CUDA tensors where PROLOGUE_COMPILE says so (as the generic
    family's COMPILE; lazily: the first call compiles); eager elsewhere, and traced with a caller's torch.compile."""
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
    wanted = PROLOGUE_COMPILE == "always" or (PROLOGUE_COMPILE == "cuda" and device is not None
                                              and device.type == "cuda")
    if not wanted or torch.compiler.is_compiling():
        return _prologue_body(*args)
    if PROLOGUE_COMPILE_BACKEND not in _PROLOGUE_COMPILED:
        _PROLOGUE_COMPILED[PROLOGUE_COMPILE_BACKEND] = torch.compile(_prologue_body, backend=PROLOGUE_COMPILE_BACKEND,
                                                                     fullgraph=True)
    return _PROLOGUE_COMPILED[PROLOGUE_COMPILE_BACKEND](*args)
'''


def render(program: ir.Program, prologue: Sequence[Transform], direct: Sequence[str]) -> tuple[str, list[str]]:
    """(the module-level code: `_prologue_body` written from the IR and its runner; the lines of the op's function
    that call it). `direct`: the kernels' operands read from inputs, whose dtype the prologue's results take."""
    from ncd.families.generic.emit import BodyEmitter, Value
    from ncd.families.generic.plan import size_sources, unused_lines_dropped
    from ncd.families.generic.render import wrap_line

    order = [t.name for t in program.tensors]
    reads = sorted({n for t in prologue for n in t.reads}, key=order.index)
    names = set(reads)
    size_code = {axis: code for axis, code in size_sources(program).items()
                 if set(re.findall(r"([A-Za-z_]\w*)\.shape", code)) <= names}
    emitter = BodyEmitter(program, size_code)
    for name in reads:
        t = program.tensor(name)
        emitter.origin = t.span
        if t.axes or t.role == "param":
            emitter.lines.append(f"{name} = {name}.to(torch.float32)  # {t.span.origin}")
        else:  # a scalar input: a float by now (the op's function filled its default)
            emitter.lines.append(f"{name} = torch.as_tensor({name}, dtype=torch.float32, device=_device)  "
                                 f"# {t.span.origin}")
        emitter.env[name] = Value(name, t.axes)
    computed = {n for t in prologue for n in t.definitions}
    for d in program.definitions:
        if d.tensor not in computed:
            continue
        tensor = program.tensor(d.tensor)
        emitter.origin = d.span
        value = emitter.to_axes(emitter.eval(d.value, {}), tensor.axes, "exact", d.span)[0]
        value = emitter.as_tensor(value, d.span) if not value.tensor else value
        if value.code in names:  # never hand back an input itself
            value = emitter.emit(f"{value.code}.clone()", value.axes, d.span)
        emitter.bind(d.tensor, value, d.span)
        emitter.env[d.tensor] = Value(d.tensor, tensor.axes)
    targets = [t.name for t in prologue]
    lines = unused_lines_dropped(emitter.lines, names | set(targets))
    body = "\n".join(lines)
    first = next((n for n in reads if program.tensor(n).axes), None)
    setup = []
    if "_device" in body or "_one" in body:
        setup.append(f"    _device = {first}.device" if first else '    _device = torch.device("cpu")')
    if "_one" in body:
        setup.append("    _one = torch.ones((), dtype=torch.float32, device=_device)")
    results = ", ".join(f"{n}.to(_dtype)" for n in targets)
    origins = ", ".join(t.span.origin for t in prologue)
    roles = ", ".join(f"{t.role} = {t.name}" for t in prologue)
    source = [
        "", "",
        "# Attention prologue (ncd/families/attention/prologue.py): what the spec computes before the score's",
        f"# contraction ({roles}), in PyTorch from the IR; autograd differentiates it, the kernels read its results.",
        "from ncd.runtime import check_floats as _check_floats  # noqa: E402",
        "from ncd.settings import settings as _settings  # noqa: E402", "",
        "PROLOGUE_COMPILE = _settings().generic_compile  # cuda | always | never (NCD_GENERIC_COMPILE)",
        'PROLOGUE_COMPILE_BACKEND = "inductor"  # (\'aot_eager\' traces it without a C++ toolchain)',
        "_PROLOGUE_COMPILED = {}", "", "",
        *wrap_line(f"def _prologue_body(_dtype, {', '.join(reads)}):", ""),
        f'    """{roles} in float32, handed over in the kernels\' dtype."""',
        *setup, *(out for line in lines for out in wrap_line(line, "    ")),
        *wrap_line(f"return {results}  # {origins}", "    "),
        *RUNNER.rstrip("\n").split("\n"),
    ]
    floats = [n for n in (*direct, *(t.source for t in prologue if t.source)) if n]
    floats = [n for n in dict.fromkeys(floats)]
    if not floats:  # no input q, k or v at all: the first float tensor the transforms read sets the dtype
        floats = [n for n in reads if program.tensor(n).role == "in" and program.tensor(n).axes][:1]
    params = [n for n in reads if program.tensor(n).role == "param" and program.tensor(n).axes]
    call = [*wrap_line("_dtype = _check_floats([" + ", ".join(f'("{n}", {n})' for n in floats) + "])"
                       if floats else "_dtype = torch.float32", "    ")]
    if params:
        call += wrap_line("_check_floats([" + ", ".join(f'("{n}", {n})' for n in params) + "], same_dtype=False)",
                          "    ")
    call += wrap_line(f"{', '.join(targets)} = _prologue(_dtype, {', '.join(reads)})  # {origins}", "    ")
    return "\n".join(source) + "\n", call
