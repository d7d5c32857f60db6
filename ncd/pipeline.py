"""The straight-line compiler pipeline. Each stage's output is verified before the next stage runs."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from . import ast, ir
from .errors import NcdError, SizeMismatch, UnknownAxis
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
    # `sizes` overrides of fixed axis sizes and family `options` (both part of the op's cache key), sorted
    sizes: tuple[tuple[str, int], ...] = ()
    options: tuple[tuple[str, str], ...] = ()

    def option(self, name: str, default: str) -> str:
        return dict(self.options).get(name, default)


def override_sizes(module: ast.Module, sizes: Mapping[str, int]) -> ast.Module:
    """The spec with the sizes of some fixed-size axes replaced (`axis deg = 9` compiled as 25): the whole
    front end, type checks included, then runs on the new sizes. Call-time axes cannot be fixed this way."""
    decls = {s.name.name: s for s in module.statements if isinstance(s, ast.AxisDecl)}
    for name, size in sizes.items():
        if name not in decls:
            raise UnknownAxis(None, name=name, choices=decls).with_source(module.source)
        decl = decls[name]
        if decl.kind != "fixed":
            raise SizeMismatch(decl.span, detail=f"axis '{name}' has no fixed size to override",
                               hint="only `axis NAME = INTEGER` declarations take a size override"
                               ).with_source(module.source)
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise SizeMismatch(decl.span, detail=f"size override for axis '{name}' must be a positive integer, "
                               f"got {size!r}").with_source(module.source)
    statements = tuple(dataclasses.replace(s, size=sizes[s.name.name])
                       if isinstance(s, ast.AxisDecl) and s.name.name in sizes else s for s in module.statements)
    return dataclasses.replace(module, statements=statements)


def front_end(text: str, filename: str = "<string>", sizes: Mapping[str, int] | None = None,
              options: Mapping[str, str] | None = None) -> FrontEnd:
    """Parse, type-check and verify a spec. Raises the first `NcdError`, with its source attached.
    `sizes` overrides fixed axis sizes; `options` are read by the kernel family (e.g. polykan's basis_eval)."""
    module = parse(text, filename)
    if sizes:
        module = override_sizes(module, sizes)
    try:
        program, warnings = lower(module)
    except NcdError as err:
        raise err.with_source(module.source) from None
    if settings().verify:
        program.verify()
    return FrontEnd(module.source, module, program, tuple(w.with_source(module.source) for w in warnings),
                    tuple(sorted((sizes or {}).items())), tuple(sorted((options or {}).items())))


def load_spec(path: str | Path, sizes: Mapping[str, int] | None = None,
              options: Mapping[str, str] | None = None) -> FrontEnd:
    path = Path(path)
    return front_end(path.read_text(encoding="utf-8"), str(path), sizes, options)
