"""The kernel-family interface. A family looks at a verified program and answers one of three ways:

- not mine: a `Decline` saying why, at the spec location that decided it (`--emit plan` lists them when the
  generic family takes the spec);
- mine: a `KernelPlan` (roles, certificate, tiling, config) that renders the generated module;
- mine but unsupported: it raises a located `NcdError` saying what to change.

The registry (`ncd/families/__init__.py`) lists the families in the order they are asked."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from . import ir
from .source import Span


@dataclass(frozen=True)
class Decline:
    """A family's "not mine": one line of why, located where the spec made it decline (None: the whole spec)."""

    reason: str
    span: Span | None = None

    def line(self, family: str) -> str:
        where = f"{self.span.origin}:{self.span.col}: " if self.span is not None else ""
        return f"{family}: {where}{self.reason}"


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


@dataclass(frozen=True)
class Family:
    """One registry line: the family's name, what it compiles, and where its entry points live (imported on first
    use, so that the front end never pays for sympy-heavy planners)."""

    name: str
    summary: str
    planner: str  # "module:function", called as function(front, bindings) -> KernelPlan | Decline
    forms: str  # "module:Class", the family's validation description (ncd/validation_forms.py)

    def load(self, target: str) -> object:
        import importlib

        module, _, attr = target.partition(":")
        return getattr(importlib.import_module(module), attr)
