"""The straight-line compiler pipeline. Each stage's output is verified before the next stage runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from . import ast, ir
from .errors import NcdError
from .lower import lower
from .parser import parse
from .settings import settings
from .source import Source

STAGES = ("ast", "ir", "plan", "triton")


@dataclass(frozen=True)
class FrontEnd:
    """A spec taken as far as verified IR."""

    source: Source
    module: ast.Module
    program: ir.Program
    warnings: tuple[NcdError, ...] = field(default=())


def front_end(text: str, filename: str = "<string>") -> FrontEnd:
    """Parse, type-check and verify a spec. Raises the first `NcdError`, with its source attached."""
    module = parse(text, filename)
    try:
        program, warnings = lower(module)
    except NcdError as err:
        raise err.with_source(module.source) from None
    if settings().verify:
        program.verify()
    return FrontEnd(module.source, module, program, tuple(w.with_source(module.source) for w in warnings))


def load_spec(path: str | Path) -> FrontEnd:
    path = Path(path)
    return front_end(path.read_text(encoding="utf-8"), str(path))
