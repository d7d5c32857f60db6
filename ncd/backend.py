"""The back half of the pipeline: a kernel family claims the verified IR and returns a plan (certificate,
roles, tiling, config and cost); the plan renders the generated module. Families are asked in registry order
(ncd/families/__init__.py); one that does not recognise a spec says why (`Decline`), one that recognises it but
cannot compile it raises a located error."""

from __future__ import annotations

import ast as pyast
import dataclasses
import functools
import hashlib
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING

from . import __version__, ast, ir
from .errors import InvalidIdentifier, InvalidStatement, NcdError, NoKernelFamily
from .family import Decline, Family, KernelPlan
from .limits import symbolic_budget
from .pipeline import FrontEnd
from .settings import settings
from .source import Span, origin_name

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable


@dataclass(frozen=True)
class Selection:
    """The family that claimed a spec, its plan, and why each family asked before it declined."""

    family: Family
    plan: KernelPlan
    declined: tuple[str, ...]  # "family: file:line:col: reason", in registry order

    def describe(self) -> list[str]:
        return [*self.plan.describe(), *(f"  declined by {line}" for line in self.declined)]


def select(front: FrontEnd, bindings: dict[str, int] | None = None) -> Selection:
    """Ask the registry's families in order; the first plan wins. A specialised family that recognises a spec but
    cannot compile it (a located `unsupported` / `not-streamable` error) counts as declining with that reason, and
    the generic family, last, compiles the spec from its IR, with a `FallbackWarning` naming the location: every
    verified spec compiles or is rejected with a located error (the specialised family's, where generic fails
    too)."""
    from .families import REGISTRY

    declined: list[str] = []
    refused: NcdError | None = None
    refused_line = ""
    with symbolic_budget(front.source, "deriving the kernel plan"):  # also gives the families' errors the source
        for index, family in enumerate(REGISTRY):
            planner = family.load(family.planner)
            try:
                found = planner(front, bindings or {})  # type: ignore[operator]
            except NcdError as err:
                if index == len(REGISTRY) - 1 and refused is not None:
                    raise refused from None  # the family that recognised the spec says what its fast path needs
                if err.code not in _FALL_THROUGH or index == len(REGISTRY) - 1:
                    raise
                found = Decline(f"recognised, but: {err.message}", err.span)
                if refused is None:
                    refused, refused_line = err.with_source(front.source), found.line(family.name)
            if isinstance(found, Decline):
                declined.append(found.line(family.name))
                continue
            _check_signature(front.program)
            if refused is not None:
                warnings.warn(FallbackWarning(f"{refused_line}; compiled by the {family.name} family instead "
                                              "(correct, but not the specialised kernels)"), stacklevel=2)
            return Selection(family, found, tuple(declined))
    outputs = front.program.outputs
    asked = "; ".join(declined) or "none (the registry is empty)"
    raise NoKernelFamily(outputs[-1].span if outputs else None, name=front.program.name, families=asked
                         ).with_source(front.source)


# A specialised family's "mine, but I cannot compile this": the spec falls through to the families after it.
_FALL_THROUGH = frozenset({"unsupported", "not-streamable"})


class FallbackWarning(UserWarning):
    """A specialised family recognised the spec but could not compile it; a later family (generic) did."""


def find_plan(front: FrontEnd, bindings: dict[str, int] | None = None) -> KernelPlan:
    return select(front, bindings).plan


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
    return select(front, bindings).plan


# What decides the generated text besides the spec: the package's code (subpackages such as the families and the
# static kernels included), codegen, templates and grammar.
_GENERATING_FILES = {"ncd": (".py",), "ncd.codegen": (".py",), "ncd.templates": (".py", ".jinja"),
                     "ncd.grammar": (".py", ".lark")}


def _generating_sources() -> list[tuple[str, bytes]]:
    """(package/path, bytes) of every installed file that generates code, subfolders included, in a fixed order."""
    found = []

    def walk(folder: Traversable, prefix: str, suffixes: tuple[str, ...]) -> None:
        for entry in folder.iterdir():
            if entry.is_dir() and entry.name != "__pycache__":
                walk(entry, f"{prefix}/{entry.name}", suffixes)
            elif entry.name.endswith(suffixes) and entry.is_file():
                found.append((f"{prefix}/{entry.name}", entry.read_bytes()))

    for package, suffixes in _GENERATING_FILES.items():
        walk(resources.files(package), package, suffixes)
    return sorted(found)


@functools.cache
def compiler_digest() -> str:
    """A hash of this compiler (version and generating sources), computed once per process: a cached module
    generated by any other compiler, even one whose version string is the same, gets another op id."""
    digest = hashlib.sha256(__version__.encode())
    for name, data in _generating_sources():
        digest.update(f"\0{name}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()


# Settings that only steer the compiler's own process, never the generated text.
_PROCESS_SETTINGS = frozenset({"verify", "debug", "cache_dir"})


def _generating_settings() -> tuple[tuple[str, object], ...]:
    """The NCD_* settings a family may read while planning or rendering (precisions, factorization, ...)."""
    current = settings()
    return tuple((f.name, getattr(current, f.name)) for f in dataclasses.fields(current)
                 if f.name not in _PROCESS_SETTINGS)


def op_id(front: FrontEnd, bindings: Mapping[str, int] | None = None,
          config: tuple[tuple[str, object], ...] = ()) -> str:
    """A name unique to everything that decides the generated text: the spec text, size overrides and options,
    the plan's `--bind` sizes, the fields of its config overridden (`config`, ncd/compiler.py: `with_config`) and
    the generating NCD_* settings, this compiler (`compiler_digest`) and the spec's
    file name as generated code shows it (`origin_name`: the origin comments of a cached module then name the file
    it was generated from). Custom ops are global per process; the cache is keyed by it. 96 bits: two specs
    colliding by design would take ~2^48 work."""
    key = repr((compiler_digest(), origin_name(front.source.filename), front.source.text, front.sizes, front.options,
                tuple(sorted((bindings or {}).items())), _generating_settings(), *((config,) if config else ())))
    digest = hashlib.sha256(key.encode()).hexdigest()
    return f"{front.program.name}_{digest[:24]}"


def generate(front: FrontEnd, kernel_plan: KernelPlan | None = None,
             bindings: Mapping[str, int] | None = None, config: tuple[tuple[str, object], ...] = ()) -> str:
    """The module of `kernel_plan` (a plan whose config has the overrides `config`, which name the op)."""
    with symbolic_budget(front.source, "generating the kernels"):
        code = (kernel_plan or plan(front, dict(bindings or {}))).render(front.program, op_id(front, bindings, config))
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
    would replace an import, a kernel, a helper or a setting). Input and parameter names become the op's
    arguments: one equal to a global (`head_tile`, `chunk`, `DEGREES`, ...) would shadow it inside the op and fail
    at call time. The identifier check catches the common names early; this catches every family's own globals."""
    names = module_globals(code)
    name = front.program.name
    if names.count(name) > 1:
        stmt = next((s for s in front.module.statements if isinstance(s, ast.SpecName)), None)
        span = stmt.name.span if stmt is not None else Span(front.source.filename, 1, 1, 1, 2)
        raise InvalidIdentifier(span, name=name, reason="the generated module has a global of that name (its "
                                "kernels, op or settings)", hint="rename the spec (`spec NAME`)",
                                ).with_source(front.source)
    taken = set(names)
    for decl in front.module.statements:
        if isinstance(decl, ast.TensorDecl) and decl.role in ("in", "param") and decl.name.name in taken:
            raise InvalidIdentifier(decl.name.span, name=decl.name.name, reason=f"the generated module has a "
                                    f"global of that name, which the op's argument '{decl.name.name}' would hide",
                                    hint=f"rename the {'input' if decl.role == 'in' else 'parameter'}",
                                    ).with_source(front.source)
