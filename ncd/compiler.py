"""The compiler driver: one straight line of named stages that returns one `Compiled` object.

    parse -> lower -> verify -> select -> plan -> render -> check -> write -> import

parse, lower and verify are the front end (ncd/pipeline.py). `select` asks the families of the registry in order
(ncd/families/__init__.py) and `plan` is the winner's plan, both done once (`ncd.backend.select`); `render` is the
plan's generated module, `check` the name and signature checks on that text, `write` and `import` the
authenticated cache (ncd/cache.py). `ncd compile --emit STAGE`, `ncd check`, `ncd.load` and validation all
consume this object, so no spec is planned twice for one op.

A plan's `config` (the family's frozen config: tiles, precisions, modes, the factorized form's choice, the
accumulation) is what a test or a benchmark changes, never the generated module's globals: `compile_spec(...,
config={"use_tma": False})`, `ncd.load(..., config=...)` or `op.with_config(use_tma=False)` compile the op whose plan
has `dataclasses.replace(plan.config, **fields)`, under its own op id (`with_config`)."""

from __future__ import annotations

import dataclasses
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

ConfigOverrides = tuple[tuple[str, object], ...]  # (field, value) pairs, sorted by field


class ConfigError(ValueError):
    """A config override the family's config does not have, or a value of the wrong kind for its field."""


def _frozen(value: object) -> object:
    """Lists (of tiles, say) as tuples: config values are hashable and print the same way every time."""
    return tuple(_frozen(v) for v in value) if isinstance(value, list | tuple) else value


def config_overrides(fields: Mapping[str, object] | None) -> ConfigOverrides:
    return tuple(sorted((name, _frozen(value)) for name, value in (fields or {}).items()))


def with_config(plan: KernelPlan, overrides: Mapping[str, object]) -> KernelPlan:
    """`plan` with `dataclasses.replace(plan.config, **overrides)`; ConfigError naming the family's config fields
    for a field it does not have, or a value whose type differs from the field's current one."""
    config = getattr(plan, "config", None)
    if config is None or not dataclasses.is_dataclass(config) or isinstance(config, type):
        raise ConfigError(f"the {plan.family} family has no config to override (asked for "
                          f"{', '.join(sorted(overrides))})")
    kind = type(config).__name__
    names = [f.name for f in dataclasses.fields(config)]
    unknown = sorted(set(overrides) - set(names))
    if unknown:
        raise ConfigError(f"{kind} (the {plan.family} family's config) has no field "
                          f"{', '.join(map(repr, unknown))}; its fields are {', '.join(names)}")
    for name, value in overrides.items():
        current = getattr(config, name)
        numeric = isinstance(current, float) and isinstance(value, int) and not isinstance(value, bool)
        if current is not None and value is not None and type(value) is not type(current) and not numeric:
            raise ConfigError(f"{kind}.{name} is a {type(current).__name__} ({current!r}), not {value!r}")
    try:
        changed = dataclasses.replace(config, **overrides)
    except (TypeError, ValueError) as error:  # the config's own checks (__post_init__)
        raise ConfigError(f"{kind}: {error}") from None
    return dataclasses.replace(plan, config=changed)  # type: ignore[type-var]


@dataclass(frozen=True)
class Compiled:
    """A spec taken through the pipeline: what each stage produced. Stages after the front end run on first use
    (`selection`, `code`) or by `compile_front(..., until="import")` (`module`, `path`), each at most once."""

    front: FrontEnd
    bindings: tuple[tuple[str, int], ...] = ()
    module: ModuleType | None = field(default=None, compare=False)
    path: Path | None = None
    config: ConfigOverrides = ()  # fields of the plan's config overridden (`with_config`), part of the op id

    @property
    def ast(self) -> ast.Module:
        return self.front.module

    @property
    def ir(self) -> ir.Program:
        return self.front.program

    @functools.cached_property
    def selection(self) -> Selection:
        found = select(self.front, dict(self.bindings))
        if not self.config:
            return found
        return dataclasses.replace(found, plan=with_config(found.plan, dict(self.config)))

    @property
    def family(self) -> str:
        return self.selection.family.name

    @property
    def plan(self) -> KernelPlan:
        return self.selection.plan

    @functools.cached_property
    def op_id(self) -> str:
        return op_id(self.front, dict(self.bindings), self.config)

    @functools.cached_property
    def code(self) -> str:
        """The rendered module, checked (`ncd.backend.generate`: its globals leave the spec's names free)."""
        return generate(self.front, self.plan, dict(self.bindings), self.config)


def compile_front(front: FrontEnd, bindings: Mapping[str, int] | None = None, until: str = "import",
                  cache_dir: str | Path | None = None, config: Mapping[str, object] | None = None) -> Compiled:
    """Run the stages after the front end up to `until` (one of STAGES); `config` overrides fields of the plan's
    config (`with_config`: a ConfigError at the `select` stage for a field the family's config lacks)."""
    compiled = Compiled(front, tuple(sorted((bindings or {}).items())), config=config_overrides(config))
    return advance(compiled, until, cache_dir)


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
    # a miss renders once and writes it. Validation asks for `selection` later: it is derived then, once. (An
    # override the config lacks fails in rendering, so no entry is ever cached under its op id.)
    module, path = import_generated(compiled.op_id, lambda: compiled.code, cache_dir)
    imported = dataclasses.replace(compiled, module=module, path=path)
    imported.__dict__.update({k: v for k, v in compiled.__dict__.items() if k in _STAGE_RESULTS})
    return imported


_STAGE_RESULTS = ("selection", "op_id", "code")  # the cached properties a later Compiled takes over


def compile_spec(path: str | Path, sizes: Mapping[str, int] | None = None, options: Mapping[str, str] | None = None,
                 bindings: Mapping[str, int] | None = None, until: str = "import",
                 cache_dir: str | Path | None = None, config: Mapping[str, object] | None = None) -> Compiled:
    """The whole pipeline for the spec file at `path`; `config` overrides fields of the plan's config."""
    return compile_front(load_spec(path, sizes, options), bindings, until, cache_dir, config)
