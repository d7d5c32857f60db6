"""The generic family's generated module: the op body from the plan, call-time checks, the compile policy, the
function named after the spec and its nn.Module. Spec text reaches the module only as checked identifiers,
integers and numbers printed by `repr`; the origin file name only through `origin_name`."""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING

from ... import ir

if TYPE_CHECKING:
    from .plan import GenericPlan


WIDTH = 120  # the project's ruff line length


def _docstring(text: str, indent: str) -> list[str]:
    """A docstring of `text` (paragraphs split by blank lines) wrapped to the line length."""
    out: list[str] = []
    for paragraph in text.split("\n\n"):
        out += [*textwrap.wrap(paragraph, WIDTH - len(indent) - 3, break_on_hyphens=False), ""]
    lines = [f'{indent}"""{out[0]}', *(f"{indent}{line}" if line else "" for line in out[1:-1])]
    if len(lines) == 1 and len(lines[0]) + 3 <= WIDTH:
        return [lines[0] + '"""']
    return [*lines, f'{indent}"""']


def _listed(head: str, items: list[str], tail: str, indent: str) -> list[str]:
    """`head item, item, ...tail` on one line, or one item a line where that is too long."""
    line = f"{indent}{head}{', '.join(items)}{tail}"
    if len(line) <= WIDTH:
        return [line]
    body = [part for item in items for part in _entry(f"{item},", "", indent + "    ")]
    return [f"{indent}{head}", *body, f"{indent}{tail.lstrip()}"]


def _broken(code: str, indent: str) -> list[str]:
    """`code` (inside brackets) broken at spaces to the line length: the generated code holds no string with a
    space, so every break falls between tokens."""
    parts = textwrap.wrap(code, WIDTH - len(indent), subsequent_indent="    ", break_long_words=False,
                          break_on_hyphens=False)
    return [f"{indent}{part}" for part in parts]


def _entry(code: str, origin: str, indent: str) -> list[str]:
    """A bracketed item (`('x', x, ('row',)),`) with its origin comment: on its line where that fits, else above."""
    if origin and len(f"{indent}{code}  # {origin}") <= WIDTH:
        return [f"{indent}{code}  # {origin}"]
    head = [f"{indent}# {origin}"] if origin else []
    return head + (_broken(code, indent) if len(indent + code) > WIDTH else [indent + code])


def wrap_line(line: str, indent: str) -> list[str]:
    """A line `CODE  # origin` within the line length: an assignment over it becomes `NAME = (`, its value broken
    at spaces, `)`; the origin comment moves above where it does not fit beside the code."""
    if len(indent + line) <= WIDTH:
        return [indent + line]
    inner = len(line) - len(line.lstrip())
    indent, line = indent + line[:inner], line[inner:]
    code, _, origin = line.rpartition("  # ")
    if not code:
        code, origin = line, ""
    if len(f"{indent}{code}") <= WIDTH or " = " not in code or code.endswith(":"):
        return [f"{indent}# {origin}", f"{indent}{code}"] if origin else [indent + code]
    name, value = code.split(" = ", 1)
    opening = f"{indent}{name} = (" + (f"  # {origin}" if origin else "")
    head = [opening] if len(opening) <= WIDTH else [f"{indent}# {origin}", f"{indent}{name} = ("]
    return [*head, *_broken(value, indent + "    "), f"{indent})"]


def _axes_table(program: ir.Program) -> list[str]:
    rows = [row for a in program.axes
            for row in _entry(f"{a.name!r}: ({a.fixed!r}, {tuple(a.factors)!r}),", a.span.origin, "    ")]
    return ["# axis -> (fixed size or None, split factors)", "_AXES = {", *rows, "}"]


def _body(plan: GenericPlan, program: ir.Program) -> list[str]:
    uses = "\n".join(plan.body)
    first = next((t.name for t in (*program.inputs, *program.params) if t.axes or t.role == "param"), None)
    prologue = []
    if "_device" in uses or "_one" in uses:
        prologue.append(f"    _device = {first}.device" if first else '    _device = torch.device("cpu")')
    if "_one" in uses:
        prologue.append("    _one = torch.ones((), dtype=torch.float32, device=_device)")
    outputs = [f"{t.name}.to(_dtype)" for t in program.outputs]
    result = outputs[0] if len(outputs) == 1 else f"({', '.join(outputs)})"
    out_origin = program.outputs[-1].span.origin
    return [*_listed("def _body(", [*plan.body_args, "_dtype"], "):", ""),
            *_docstring(f"The op on float32 values: {plan.program_name} from {plan.origin}, written out from its IR.",
                        "    "),
            *prologue, *(out for line in plan.body for out in wrap_line(line, "    ")),
            *wrap_line(f"return {result}  # {out_origin}", "    ")]


_RUN = '''
def _run(*args):
    """`_body`, through torch.compile where COMPILE says so (lazily: the first call compiles)."""
    if COMPILE not in ("cuda", "always", "never"):
        raise ValueError(f"COMPILE must be 'cuda', 'always' or 'never', not {COMPILE!r}")
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
    wanted = COMPILE == "always" or (COMPILE == "cuda" and device is not None and device.type == "cuda")
    if not wanted or torch.compiler.is_compiling():  # inside a caller's torch.compile: traced with it
        return _body(*args)
    if COMPILE_BACKEND not in _COMPILED:
        _COMPILED[COMPILE_BACKEND] = torch.compile(_body, backend=COMPILE_BACKEND, fullgraph=True)
    return _COMPILED[COMPILE_BACKEND](*args)


def _same_device(tensors):
    first_name, first = tensors[0]
    for name, tensor in tensors[1:]:
        if tensor.device != first.device:
            raise _rt.CallError(None, detail=f"{name} is on {tensor.device}, {first_name} on {first.device}")
'''

# Emitted where the spec declares integer inputs. Validation draws every input as floats, so any real dtype passes.
_INTEGERS = '''

def _integer_inputs(tensors):
    for name, tensor, declared in tensors:
        if tensor.is_complex():
            raise _rt.CallError(None, detail=f"{name} has dtype {tensor.dtype}; it is declared {declared}: pass an "
                                "integer (or bool) tensor")
'''
INTEGER_DTYPES = ("i32", "i64", "bool")
AMBIGUOUS_NAMES = {"l", "O", "I"}  # ruff E741


def integer_inputs(program: ir.Program) -> list[str]:
    """Tensor inputs declared i32/i64/bool (mask data: lengths, document ids): they keep their integer dtype at the
    call, are upcast in the body like the others, and do not decide the outputs' dtype."""
    return [t.name for t in program.inputs if t.axes and t.dtype in INTEGER_DTYPES]


_SOLVE = '''

def _chebyshev(a, b, mu, lip, iterations):
    """Chebyshev iteration for SPD `a` with spectrum in [mu, lip] (ncd.reference.chebyshev_iteration)."""
    kappa_ratio = (lip - mu) / (lip + mu)
    x_prev = torch.zeros_like(b)
    x = 2 * b / (lip + mu)
    omega = torch.full_like(mu, 2.0)
    for _ in range(iterations):
        omega = 1 / (1 - omega * kappa_ratio**2 / 4)
        r = b - (a @ x.unsqueeze(-1)).squeeze(-1)
        x, x_prev = omega * (x - x_prev + 2 / (lip + mu) * r) + x_prev, x
    return x


class _ImplicitSolve(torch.autograd.Function):
    """chebyshev_solve: the iterations forward, differentiated as the exact solve of A x = b (docs/language.md,
    section 17): db = z with A^T z = dx by the same iterations, dA = -z x^T, none for mu and L."""

    @staticmethod
    def forward(ctx, a, b, mu, lip, iterations):
        x = _chebyshev(a, b, mu, lip, iterations)
        ctx.save_for_backward(a, x, mu, lip)
        ctx.iterations = iterations
        return x

    @staticmethod
    def backward(ctx, dx):
        a, x, mu, lip = ctx.saved_tensors
        z = _chebyshev(a.transpose(-1, -2), dx, mu, lip, ctx.iterations)
        return -z.unsqueeze(-1) * x.unsqueeze(-2), z, None, None, None
'''


def _function(plan: GenericPlan, program: ir.Program) -> list[str]:
    from .plan import scalar_arguments, tensor_arguments

    tensors, scalars = tensor_arguments(program), scalar_arguments(program)
    decl = {t.name: t for t in program.tensors}
    signature = tensors + (["*"] if scalars else []) + [f"{n}=None" if decl[n].default is not None else n
                                                         for n in scalars]
    outputs = ", ".join(f"{t.name}[{' '.join(t.axes)}]" for t in program.outputs)
    doc = (f"{plan.program_name} from {plan.origin} (ncd generic family): returns {outputs}.\n\nPositional: the "
           f"spec's tensor inputs, then its parameters ({', '.join(tensors) or 'none'}).")
    if scalars:
        doc += (f" Keyword-only: its scalar inputs ({', '.join(scalars)}), numbers or one-element tensors; None takes "
                "the default.")
    doc += (" Computed in float32 (inputs are upcast); outputs come back in the inputs' dtype. The backward is "
            "PyTorch autograd; on CUDA tensors the function runs through torch.compile (see COMPILE).")
    lines = [*_listed(f"def {plan.program_name}(", signature, "):", ""), *_docstring(doc, "    ")]
    lines += ["    # locals start with '_' so they can never collide with the spec's (checked, letter-first) names",
              "    _sizes = _rt.bind_axes(_AXES, ["]
    for name in tensors:
        t = decl[name]
        lines += _entry(f"({name!r}, {name}, {tuple(t.axes)!r}),", t.span.origin, "        ")
    lines.append("    ])")
    integers = integer_inputs(program)
    inputs = [n for n in tensors if decl[n].role == "in" and n not in integers]
    params = [n for n in tensors if decl[n].role == "param"]
    if integers:
        lines += _listed("_integer_inputs([", [f"({n!r}, {n}, {decl[n].dtype!r})" for n in integers], "])", "    ")
    if inputs:
        lines += _listed("_dtype = _rt.check_floats([", [f"({n!r}, {n})" for n in inputs], "])", "    ")
    else:
        lines.append("    _dtype = torch.float32")
    if params:
        lines += _listed("_rt.check_floats([", [f"({n!r}, {n})" for n in params], "], same_dtype=False)", "    ")
    if tensors:
        lines += _listed("_same_device([", [f"({n!r}, {n})" for n in tensors], "])", "    ")
    for name in scalars:
        t = decl[name]
        if t.default is None:
            lines += wrap_line(f"{name} = _rt.scalar_input({name!r}, {name}, differentiable=True)  # {t.span.origin}",
                               "    ")
        else:
            lines += wrap_line(f"if {name} is not None:  # {t.span.origin}", "    ")
            lines += wrap_line(f"{name} = _rt.scalar_input({name!r}, {name}, differentiable=True)", "        ")
    lines += _listed("return _run(", [*tensors, *scalars, "_dtype"], ")", "    ")
    return lines


def _module_class(plan: GenericPlan, program: ir.Program) -> list[str]:
    from .plan import scalar_arguments, tensor_arguments

    decl = {t.name: t for t in program.tensors}
    params = [t.name for t in program.params]
    inputs = [n for n in tensor_arguments(program) if decl[n].role == "in"]
    scalars = scalar_arguments(program)
    held = f"holds its parameters ({', '.join(params)}) as nn.Parameters, " if params else ""
    lines = ["class Module(torch.nn.Module):",
             *_docstring(f"`{plan.program_name}` as an nn.Module: {held}forward takes the inputs "
                         f"({', '.join(inputs + scalars) or 'none'}).", "    "), ""]
    if params:
        lines += _listed("def __init__(", ["self", *params], "):", "    ")
        lines.append('        """Each parameter\'s initial value (a tensor of its declared axes), copied."""')
        lines.append("        super().__init__()")
        for name in params:
            value = f"torch.nn.Parameter(torch.as_tensor({name}).detach().clone())"
            lines += wrap_line(f"self.{name} = {value}", "        ")
        lines.append("")
    keyword = (["*"] if scalars else []) + [f"{n}=None" if decl[n].default is not None else n for n in scalars]
    lines += _listed("def forward(", ["self", *inputs, *keyword], "):", "    ")
    call = [*inputs, *(f"self.{p}" for p in params), *(f"{n}={n}" for n in scalars)]
    lines += _listed(f"return {plan.program_name}(", call, ")", "        ")
    return lines


def render_module(plan: GenericPlan, program: ir.Program, op_id: str) -> str:
    doc = (f"`{plan.program_name}` from {plan.origin}, generated by ncd (generic family): a PyTorch function built "
           "from the spec's IR, one line per node with its `# spec.ncd:LINE` origin. Its backward is PyTorch autograd. "
           "COMPILE (default from NCD_GENERIC_COMPILE) decides where torch.compile runs it: 'cuda' (CUDA tensors only; "
           "Inductor lowers it to Triton), 'always', or 'never'. COMPILE_BACKEND is the backend ('aot_eager' traces "
           "it without a C++ toolchain).")
    ambiguous = sorted({t.name for t in program.tensors} & AMBIGUOUS_NAMES)
    # spec tensors are locals and arguments under their own names; `O` (an attention output) is ruff's E741
    noqa = [f"# spec names kept as written: {', '.join(ambiguous)}", "# ruff: noqa: E741", ""] if ambiguous \
        else []
    header = [*_docstring(doc, ""), "", *noqa,
              "import torch", "", "import ncd.runtime as _rt", "from ncd.settings import settings as _settings", "",
              f"OP_ID = {op_id!r}", *_axes_table(program),
              "COMPILE = _settings().generic_compile", 'COMPILE_BACKEND = "inductor"', "_COMPILED = {}", "", ""]
    solve = _SOLVE.split("\n") if plan.solves else []
    integers = _INTEGERS.split("\n")[:-1] if integer_inputs(program) else []
    parts = [*header, *_body(plan, program), "", *_RUN.split("\n"), *integers, *solve, "", *_function(plan, program),
             "", "", *_module_class(plan, program)]
    return "\n".join(parts).rstrip("\n") + "\n"
