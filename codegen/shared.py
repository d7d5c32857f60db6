"""What every family's code generator uses: the Jinja environment of the templates left, spec defaults as Python
text, and the error for a derived expression that cannot be spliced. Families import these, never each other's."""

from __future__ import annotations

from importlib.resources import files

import jinja2
import sympy

from ncd import ir
from ncd.symbolic import to_sympy


class CodegenError(ValueError):
    """A derived expression that cannot be spliced into generated code (a compiler bug, never a user mistake)."""


def environment() -> jinja2.Environment:
    """Templates load as package resources (`ncd.templates`), the same from a checkout, an editable install or a
    wheel; undefined names are errors, never empty text."""
    return jinja2.Environment(
        loader=jinja2.FunctionLoader(lambda name: files("ncd.templates").joinpath(name).read_text("utf-8")),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )


def default_code(program: ir.Program, tensor: ir.Tensor) -> str:
    """A scalar input's default as Python text: a number, or a float of the call's axis sizes (`_sizes[...]`)."""
    assert tensor.default is not None
    expr = to_sympy(tensor.default, {a.name: a for a in program.axes})
    if not expr.free_symbols:
        return repr(float(expr))
    names = {s: sympy.Symbol(f"sizes_{s.name}") for s in expr.free_symbols}
    code = sympy.pycode(expr.subs(names), fully_qualified_modules=True)
    for s in expr.free_symbols:
        code = code.replace(f"sizes_{s.name}", f'_sizes["{s.name}"]')
    return f"float({code})"
