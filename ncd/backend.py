"""The back half of the pipeline: a kernel family claims the verified IR and returns a plan (certificate,
roles, tiling and cost); the plan renders the generated module. Families are tried in order; one that does
not recognise a spec returns None, one that recognises it but cannot compile it raises a located error."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from importlib import resources
from typing import Protocol

from . import __version__, ir
from .errors import InvalidStatement
from .pipeline import FrontEnd


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
    return (kernel_plan or plan(front)).render(front.program, op_id(front))
