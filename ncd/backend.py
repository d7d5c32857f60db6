"""The back half of the pipeline: a kernel family claims the verified IR and returns a plan (certificate,
roles, tiling and cost); the plan renders the generated module. Families are tried in order; one that does
not recognise a spec returns None, one that recognises it but cannot compile it raises a located error."""

from __future__ import annotations

import ast as pyast
import hashlib
from collections.abc import Callable
from importlib import resources
from typing import Protocol

from . import __version__, ast, ir
from .errors import InvalidIdentifier, InvalidStatement
from .pipeline import FrontEnd
from .source import Span


class KernelPlan(Protocol):
    family: str

    @property
    def output(self) -> str: ...

    def describe(self) -> list[str]: ...

    def render(self, program: ir.Program, op_id: str) -> str: ...

    def validation_sizes(self, program: ir.Program) -> dict[str, int]:
        """Small odd sizes for every axis, for numerical validation."""
        ...

    def constant_inputs(self) -> frozenset[str]:
        """Inputs that get no gradient (e.g. attention's per-key multiplicities, drawn positive)."""
        ...


def _families() -> list[Callable[[FrontEnd, dict[str, int]], KernelPlan | None]]:
    from .attention import plan_attention
    from .polykan import plan_polykan
    from .rational import plan_rational
    from .recurrence import plan_recurrence

    return [plan_attention, plan_rational, plan_polykan, plan_recurrence]


def find_plan(front: FrontEnd, bindings: dict[str, int] | None = None) -> KernelPlan | None:
    for family in _families():
        found = family(front, bindings or {})
        if found is not None:
            _check_signature(front.program)
            return found
    return None


def _check_signature(program: ir.Program) -> None:
    """Generated ops take the spec's inputs positionally, so inputs with defaults must come last."""
    optional = None
    for t in program.inputs:
        if t.default is not None:
            optional = optional or t
        elif optional is not None:
            raise InvalidStatement(t.span, detail=f"input '{t.name}' has no default but follows '{optional.name}', "
                                   "which has one", hint="the op's positional arguments follow the `in` lines: "
                                   "declare inputs with defaults last")


def plan(front: FrontEnd, bindings: dict[str, int] | None = None) -> KernelPlan:
    found = find_plan(front, bindings)
    if found is None:
        raise InvalidStatement(None, detail=f"spec '{front.program.name}' matches no kernel family yet "
                               "(code generation exists for normalized-contraction attention)",
                               hint="other families stop at verified IR: see `ncd check`")
    return found


def _template_digest() -> str:
    digest = hashlib.sha256()
    for template in sorted(resources.files("ncd.templates").iterdir(), key=lambda p: p.name):
        if template.name.endswith(".jinja"):
            digest.update(template.read_bytes())
    return digest.hexdigest()


def op_id(front: FrontEnd) -> str:
    """A name unique to this spec text, this ncd and these templates (custom ops are global per process)."""
    digest = hashlib.sha256(f"{__version__}\0{_template_digest()}\0{front.source.text}\0{front.sizes}\0"
                            f"{front.options}".encode()).hexdigest()
    return f"{front.program.name}_{digest[:12]}"


def generate(front: FrontEnd, kernel_plan: KernelPlan | None = None) -> str:
    code = (kernel_plan or plan(front)).render(front.program, op_id(front))
    _check_name_is_free(front, code)
    return code


def module_globals(code: str) -> list[str]:
    """Every module-level binding of `code`, in order; a name bound twice is listed twice."""
    names: list[str] = []

    def visit(body: list[pyast.stmt]) -> None:
        for node in body:
            if isinstance(node, pyast.FunctionDef | pyast.ClassDef):
                names.append(node.name)
            elif isinstance(node, pyast.Assign | pyast.AnnAssign):
                targets = node.targets if isinstance(node, pyast.Assign) else [node.target]
                names.extend(n.id for t in targets for n in pyast.walk(t) if isinstance(n, pyast.Name))
            elif isinstance(node, pyast.Import | pyast.ImportFrom):
                names.extend((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, pyast.If | pyast.Try):  # guarded imports and settings
                visit(node.body + node.orelse + [s for h in getattr(node, "handlers", []) for s in h.body])

    visit(pyast.parse(code).body)
    return names


def _check_name_is_free(front: FrontEnd, code: str) -> None:
    """The spec's name becomes the op's function in the generated module: no other global may carry it (it
    would replace an import, a kernel, a helper or a setting). The identifier check catches the common names
    early; this catches every family's own globals."""
    name = front.program.name
    if module_globals(code).count(name) > 1:
        stmt = next((s for s in front.module.statements if isinstance(s, ast.SpecName)), None)
        span = stmt.name.span if stmt is not None else Span(front.source.filename, 1, 1, 1, 2)
        raise InvalidIdentifier(span, name=name, reason="the generated module has a global of that name (its "
                                "kernels, op or settings)", hint="rename the spec (`spec NAME`)",
                                ).with_source(front.source)
