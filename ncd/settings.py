"""Every NCD_* environment switch, read in one place."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


def _flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    return default if value is None else value.strip().lower() not in ("", "0", "false", "no", "off")


def _choice(name: str, allowed: tuple[str, ...]) -> str | None:
    value = os.environ.get(name, "").strip().lower() or None
    if value is not None and value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}, not {value!r}")
    return value


def _bytes(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    if not value.isdigit():
        raise ValueError(f"{name} must be a whole number of bytes (0 or more), not {value!r}")
    return int(value)


def default_cache_root() -> Path:
    """The per-user cache root: $XDG_CACHE_HOME/ncd (an absolute XDG_CACHE_HOME only, as the XDG spec says), else
    ~/.cache/ncd. It holds the cache's key (ncd/cache.py) even when NCD_CACHE_DIR moves the entries elsewhere."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = xdg if os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")
    return absolute_path(os.path.join(base, "ncd"))


@functools.cache
def absolute_path(path: str) -> Path:
    """`path` made absolute against the working directory the first time this process sees it, so a relative
    NCD_CACHE_DIR keeps naming one directory when the process later changes directory (into a cloned repository,
    say)."""
    return Path(os.path.abspath(os.path.expanduser(path)))


@dataclass(frozen=True)
class Settings:
    verify: bool  # NCD_VERIFY: re-verify the IR after every stage (default on)
    debug: bool  # NCD_DEBUG: show Python tracebacks for internal errors
    cache_dir: Path  # NCD_CACHE_DIR: where compiled ops are cached (absolute; default_cache_root() when unset)
    attention_factorize: str  # NCD_ATTENTION_FACTORIZE: auto (cost model) | always | never
    # NCD_GKA_DOT_PRECISION: fp16x3 | fp16 | tf32 | tf32x3 | ieee | bf16 (None: by dtype)
    gka_dot_precision: str | None = None
    gka_grad_precision: str | None = None  # NCD_GKA_GRAD_PRECISION: fp16x3 (default) | tf32x3 | tf32 | ieee
    # NCD_ATTENTION_DS_BUFFER_BYTES: the largest dS buffer the attention backward may allocate to skip
    # recomputing S and dP in its dQ kernel (0: never); None keeps the generated module's default (4 GiB)
    attention_ds_buffer_bytes: int | None = None
    # NCD_FIT_CARVEOUT: give kernels that spill registers more L1 (ncd/families/recurrence/carveout.py; default on)
    fit_carveout: bool = True
    # NCD_FAST_LAUNCH: launch compiled kernels directly after their first call (ncd/launch.py; default on)
    fast_launch: bool = True
    # NCD_GENERIC_COMPILE: where generic-family ops run through torch.compile: cuda (CUDA tensors; default) | always
    # | never (eager everywhere). Read when a generated module is imported (its COMPILE)
    generic_compile: str = "cuda"
    # NCD_TUNE_CACHE: keep autotuning decisions on disk, per device, under the cache directory (ncd/tuning.py;
    # default on); 0 tunes afresh in every process
    tune_cache: bool = True

    @classmethod
    def from_env(cls) -> Settings:
        raw_cache = os.environ.get("NCD_CACHE_DIR", "")
        cache = absolute_path(raw_cache) if raw_cache else default_cache_root()
        factorize = os.environ.get("NCD_ATTENTION_FACTORIZE", "auto").strip().lower()
        if factorize not in ("auto", "always", "never"):
            raise ValueError(f"NCD_ATTENTION_FACTORIZE must be auto, always or never, not {factorize!r}")
        precision = _choice("NCD_GKA_DOT_PRECISION", ("fp16x3", "fp16", "tf32", "tf32x3", "ieee", "bf16"))
        grad_precision = _choice("NCD_GKA_GRAD_PRECISION", ("fp16x3", "tf32x3", "tf32", "ieee"))
        return cls(verify=_flag("NCD_VERIFY", True), debug=_flag("NCD_DEBUG", False), cache_dir=cache,
                   attention_factorize=factorize, gka_dot_precision=precision, gka_grad_precision=grad_precision,
                   attention_ds_buffer_bytes=_bytes("NCD_ATTENTION_DS_BUFFER_BYTES"),
                   fit_carveout=_flag("NCD_FIT_CARVEOUT", True), fast_launch=_flag("NCD_FAST_LAUNCH", True),
                   generic_compile=_choice("NCD_GENERIC_COMPILE", ("cuda", "always", "never")) or "cuda",
                   tune_cache=_flag("NCD_TUNE_CACHE", True))


def settings() -> Settings:
    return Settings.from_env()


# A debugging aid, not a plan decision (so not part of any op's config or id): every family fills its output and
# workspace buffers with NaN before its kernels write them, so an element a kernel forgets to store shows up. The
# tests (tests/conftest.py sets NCD_POISON_OUTPUTS=1) and `ncd check` switch it on. NCD_POISON_OUTPUTS is read when
# this module is imported; `poisoned()` switches it for a block. Launchers read `POISON_OUTPUTS` at each allocation
# (a module attribute: no call, no environment look-up).
POISON_OUTPUTS: bool = _flag("NCD_POISON_OUTPUTS", False)


def poison_outputs() -> bool:
    """Whether kernels' output buffers start as NaN now."""
    return POISON_OUTPUTS


@contextlib.contextmanager
def poisoned(on: bool = True) -> Iterator[None]:
    """Output buffers filled with NaN before every launch inside the block (`on=False`: not), then as before."""
    global POISON_OUTPUTS
    saved = POISON_OUTPUTS
    POISON_OUTPUTS = on
    try:
        yield
    finally:
        POISON_OUTPUTS = saved
