"""The compiler driver: one straight line of named stages that returns one `Compiled` object.

    parse -> lower -> verify -> select -> plan -> render -> check -> write -> import

parse, lower and verify are the front end (ncd/pipeline.py). `select` asks the families of the registry in order
(ncd/families/__init__.py) and `plan` is the winner's plan, both done once (`ncd.backend.select`); `render` is the
plan's generated module, `check` the name and signature checks on that text, `write` and `import` the
authenticated cache (ncd/cache.py). `ncd compile --emit STAGE`, `ncd check`, `ncd.load` and validation all
consume this object, so no spec is planned twice for one op."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from . import ast, ir
from .backend import KernelPlan, Selection, generate, op_id, select
from .cache import import_generated
from .pipeline import FrontEnd, load_spec

STAGES = ("parse", "lower", "verify", "select", "plan", "render", "check", "write", "import")


@dataclass(frozen=True)
class Compiled:
    """A spec taken through the pipeline: what each stage produced. Stages after the front end run on first use
    (`selection`, `code`) or by `compile_front(..., until="import")` (`module`, `path`), each at most once."""

    front: FrontEnd
    bindings: tuple[tuple[str, int], ...] = ()
    module: ModuleType | None = field(default=None, compare=False)
    path: Path | None = None

    @property
    def ast(self) -> ast.Module:
        return self.front.module

    @property
    def ir(self) -> ir.Program:
        return self.front.program

    @functools.cached_property
    def selection(self) -> Selection:
        return select(self.front, dict(self.bindings))

    @property
    def family(self) -> str:
        return self.selection.family.name

    @property
    def plan(self) -> KernelPlan:
        return self.selection.plan

    @functools.cached_property
    def op_id(self) -> str:
        return op_id(self.front, dict(self.bindings))

    @functools.cached_property
    def code(self) -> str:
        """The rendered module, checked (`ncd.backend.generate`: its globals leave the spec's names free)."""
        return generate(self.front, self.plan, dict(self.bindings))


def compile_front(front: FrontEnd, bindings: Mapping[str, int] | None = None, until: str = "import",
                  cache_dir: str | Path | None = None) -> Compiled:
    """Run the stages after the front end up to `until` (one of STAGES)."""
    return advance(Compiled(front, tuple(sorted((bindings or {}).items()))), until, cache_dir)


def advance(compiled: Compiled, until: str = "import", cache_dir: str | Path | None = None) -> Compiled:
    """`compiled` taken on to stage `until`, keeping what its earlier stages produced (`ncd check` prints the plan,
    then validates the op built from the same object)."""
    if until not in STAGES:
        raise ValueError(f"until must be one of {STAGES}, not {until!r}")
    stop = STAGES.index(until)
    if stop < STAGES.index("write"):
        if stop >= STAGES.index("select"):
            compiled.selection  # noqa: B018  (runs the stage)
        if stop >= STAGES.index("render"):
            compiled.code  # noqa: B018
        return compiled
    if compiled.module is not None:
        return compiled
    # A cached module is imported without selecting or rendering again (the op id does not depend on the plan);
    # a miss renders once and writes it. Validation asks for `selection` later: it is derived then, once.
    module, path = import_generated(compiled.op_id, lambda: compiled.code, cache_dir)
    imported = Compiled(compiled.front, compiled.bindings, module, path)
    imported.__dict__.update({k: v for k, v in compiled.__dict__.items() if k in _STAGE_RESULTS})
    return imported


_STAGE_RESULTS = ("selection", "op_id", "code")  # the cached properties a later Compiled takes over


def compile_spec(path: str | Path, sizes: Mapping[str, int] | None = None, options: Mapping[str, str] | None = None,
                 bindings: Mapping[str, int] | None = None, until: str = "import",
                 cache_dir: str | Path | None = None) -> Compiled:
    """The whole pipeline for the spec file at `path`."""
    return compile_front(load_spec(path, sizes, options), bindings, until, cache_dir)
