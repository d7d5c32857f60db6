"""`ncd.load(path)`: compile a spec (or reuse the cached result), import the generated module, return the op.

Generated modules are cached by content hash under the user cache directory (NCD_CACHE_DIR). Writes go to a
temporary file that is renamed into place, so processes compiling the same spec at once never see a torn
file: they write identical text and the last rename wins."""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from .backend import generate, op_id
from .pipeline import FrontEnd, load_spec
from .settings import settings


class Op:
    """A compiled spec: call it like a function; `.module` is the generated code, `.Module` an nn.Module."""

    def __init__(self, front: FrontEnd, module: ModuleType, path: Path) -> None:
        self.front = front
        self.module = module
        self.path = path
        self.name = front.program.name
        # positional arguments: the spec's inputs, then its parameters, in declaration order
        self.signature = (*front.program.inputs, *front.program.params)
        self.fn = getattr(module, self.name)
        self.Module = module.Module
        self.__doc__ = self.fn.__doc__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<ncd op {self.name} from {self.front.source.filename}>"


def _write_atomically(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _import(path: Path, name: str) -> ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def import_generated(ident: str, render: Callable[[], str], cache_dir: str | Path | None = None
                     ) -> tuple[ModuleType, Path]:
    """Import generated module `ident` from the cache, rendering and writing it first if it is missing.
    Triton's JIT reads kernel source from files, so generated code always lives in a real file."""
    directory = Path(cache_dir) if cache_dir is not None else settings().cache_dir
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / f"{ident}.py"
    if not target.is_file():
        _write_atomically(target, render())
    return _import(target, f"ncd_generated_{ident}"), target


def load(path: str | Path, cache_dir: str | Path | None = None, sizes: Mapping[str, int] | None = None,
         options: Mapping[str, str] | None = None) -> Op:
    """Compile the spec at `path` (cached by content) and return its op. `sizes` overrides fixed axis sizes
    (`sizes={"deg": 25}` compiles `axis deg = 9` as 25, re-checking the spec); `options` are family options
    (polykan: `{"basis_eval": "lut" | "recurrence"}`). Both are part of the cache key."""
    front = load_spec(path, sizes, options)
    module, target = import_generated(op_id(front), lambda: generate(front), cache_dir)
    return Op(front, module, target)


# --- shipped ops with library conventions -------------------------------------------------------------------

_GKA_OPS: dict[tuple[int, int], Op] = {}


def shipped_spec(name: str) -> Path:
    """A spec shipped with ncd (package data `ncd.specs`)."""
    from importlib import resources

    return Path(str(resources.files("ncd.specs").joinpath(f"{name}.ncd")))


def chunk_gka(q: Any, k: Any, v: Any, g: Any, beta: Any = None, alpha: Any = None, scale: float | None = None,
              ridge: float = 0.02, num_iter: int = 30, initial_state: Any = None, output_final_state: bool = False,
              cu_seqlens: Any = None, chunk_size: int = 64) -> Any:
    """Gated KalmaNet core compiled from `specs/gka.ncd`, with fla's conventions: q, k [B, T, H, K],
    v [B, T, H, V], g [B, T, H] natural-log gates (<= 0), beta / alpha [B, T, H] (None: no key/value scaling;
    alpha = 1), scale default K^-1/2, states (H [N, H, K, K], S [N, H, K, V]) fp32, `cu_seqlens` packs N
    sequences into B = 1. Returns (o [B, T, H, V], final_state or None). Any head sizes: the spec is compiled
    once per (K, V) with its fixed axes overridden."""
    key = (int(q.shape[-1]), int(v.shape[-1]))
    if key not in _GKA_OPS:
        _GKA_OPS[key] = load(shipped_spec("gka"), sizes={"kdim": key[0], "vdim": key[1]})
    return _GKA_OPS[key].module.chunk(q, k, v, g, beta, alpha, scale, ridge, num_iter, initial_state,
                                      output_final_state, cu_seqlens, chunk_size)
