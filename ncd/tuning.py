"""Autotuning that is remembered across processes and shows that it is working.

`autotune(configs, key, name=...)` is `triton.autotune` (same arguments) with two additions:

- Every decision is kept on disk, in `<cache dir>/tuning/<device>.json` (NCD_CACHE_DIR or the per-user cache root),
  keyed by the device (name, compute capability, Triton and CUDA versions: one file each), the kernel (its JIT
  `cache_key`, a hash of its source and of what it calls, and the caller's `name`), the config list, the JIT
  functions passed to it (a spec's hooks) and the tuning key exactly as Triton's autotuner computes it (the `key`
  arguments' values, then the dtype of every tensor argument). A later process that meets the same key picks the
  stored config without benchmarking. NCD_TUNE_CACHE=0 turns this off.
- While it benchmarks, it says so on stderr (`ncd: tuning NAME for key (...): config 3/12`; one line redrawn with
  `\\r` on a terminal, tqdm's bar when tqdm is installed, plain lines otherwise) and ends with a one-line summary.

A stored decision is data, never code: an entry names a config by its parameters, and is used only when they
equal those of one of the configs the autotuner was given and kept after pruning at this call; that config object
(with its pre_hook) is what runs. The directory is held to the cache's rules (ncd/cache.py: created 0700, refused
if another user owns it or others may write it, with a warning, and then nothing is read or written); a file
that is corrupt, planted through a link, writable by others or from another device is ignored and replaced.

The mechanism is Triton's own autotuner, subclassed: `prune_configs` (which Triton calls only when its in-memory
cache misses) looks the key up on disk and, on a hit, returns just the stored config, which Triton then uses
without benchmarking (Triton 3.6 still benchmarks a single pruned config: `_bench` answers for it without
running anything); `_bench` reports progress; `run` writes the decision after a benchmark. Under Triton's CPU
interpreter (TRITON_INTERPRET=1) it is Triton's autotuner unchanged.

Why not Triton's `cache_results=True`: it skips its cache whenever a config has a pre_hook (the attention
kernels' configs all have one: the TMA descriptors' tile), its key has the compile target (sm_90) but not the
device (an H100 PCIe and an H100 SXM, or an H200, would share decisions measured on another), it loads any
config the file names without checking it against the config list, it keeps its files in Triton's cache with no
ownership or permission checks, and it says nothing while it benchmarks."""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import math
import os
import re
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from triton.runtime.autotuner import Autotuner

from .cache import CacheError, _private_directory, _read_file, _write_atomically, cache_directory
from .settings import settings

FORMAT = "ncd-tuning-1"
MAX_ENTRIES = 4096  # per device file; the oldest go first
_DTYPE = re.compile(r"^torch\.")


# --- what a decision is keyed by ------------------------------------------------------------------------------


def interpreting() -> bool:
    """Kernels run in Triton's CPU interpreter: nothing to tune or keep."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_DEVICES: dict[int, dict[str, str]] = {}


def device_identity() -> dict[str, str]:
    """The current CUDA device as tuning results depend on it: its name and compute capability, and the Triton
    and CUDA (or HIP) versions that compile for it."""
    import torch
    import triton

    index = torch.cuda.current_device()
    if index not in _DEVICES:
        major, minor = torch.cuda.get_device_capability(index)
        _DEVICES[index] = {"name": torch.cuda.get_device_name(index), "capability": f"{major}.{minor}",
                           "triton": triton.__version__, "cuda": str(torch.version.cuda or torch.version.hip or "")}
    return _DEVICES[index]


def _plain(value: Any) -> Any:
    """`value` as JSON that is the same in every process (a JIT function by its source hash, a tensor by its
    dtype and shape)."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if hasattr(value, "dtype") and hasattr(value, "shape"):
        return f"tensor {list(value.shape)} {value.dtype}"
    key = getattr(value, "cache_key", None)
    return f"{type(value).__name__} {key}" if isinstance(key, str) else f"{type(value).__name__} {value!r}"


def _is_jit_function(value: Any) -> bool:
    from triton.runtime.jit import JITFunction

    return isinstance(value, JITFunction)


def config_description(config: Any) -> dict[str, Any] | None:
    """The parameters that make up a config, as JSON data (None: a parameter that JSON cannot hold)."""
    desc = {"kwargs": dict(config.kwargs), "num_warps": config.num_warps, "num_stages": config.num_stages,
            "num_ctas": getattr(config, "num_ctas", 1), "maxnreg": getattr(config, "maxnreg", None)}
    try:
        return json.loads(json.dumps(desc, allow_nan=False))
    except (TypeError, ValueError):
        return None


def config_text(config: Any) -> str:
    parts = [f"{k}={v}" for k, v in config.kwargs.items()]
    parts += [f"num_warps={config.num_warps}", f"num_stages={config.num_stages}"]
    if getattr(config, "maxnreg", None) is not None:
        parts.append(f"maxnreg={config.maxnreg}")
    return ", ".join(parts)


def _kernel_identity(autotuner: Autotuner) -> str:
    """The JIT function's `cache_key` (its source and what it calls), else its module, name and source hash."""
    fn: Any = autotuner.fn
    while fn is not None and not _is_jit_function(fn):
        fn = getattr(fn, "fn", None)
    key = getattr(fn, "cache_key", None) if fn is not None else None
    base = autotuner.base_fn
    where = f"{getattr(base, '__module__', '?')}.{getattr(base, '__qualname__', '?')}"
    if isinstance(key, str):
        return f"{where} {key}"
    try:
        source = inspect.getsource(base)
    except (OSError, TypeError):
        source = ""
    return f"{where} {hashlib.sha256(source.encode()).hexdigest()}"


@dataclass(frozen=True)
class TuningKey:
    """One call's tuning key, split as Triton builds it: the `key` arguments present, then every dtype."""

    named: tuple[tuple[str, Any], ...]
    dtypes: tuple[str, ...]

    @classmethod
    def of(cls, arg_names: list[str], keys: list[str], nargs: dict[str, Any], kwargs: dict[str, Any]) -> TuningKey:
        args = {k: v for k, v in {**nargs, **kwargs}.items() if k in arg_names}
        return cls(tuple((k, args[k]) for k in keys if k in args),
                   tuple(str(v.dtype) for v in args.values() if hasattr(v, "dtype")))

    def plain(self) -> list[Any]:
        return [[name, _plain(value)] for name, value in self.named] + list(self.dtypes)

    def text(self) -> str:
        named = [f"{name}={_short(value)}" for name, value in self.named]
        dtypes = [_DTYPE.sub("", d) for d in self.dtypes]
        return "(" + ", ".join(named + ([" ".join(dtypes)] if dtypes else [])) + ")"


def _short(value: Any) -> str:
    text = getattr(value, "__name__", None) if _is_jit_function(value) else None
    return text if isinstance(text, str) else str(_plain(value))


# --- the file ---------------------------------------------------------------------------------------------------


_WARNED: set[str] = set()
_FILE_LOCK = threading.Lock()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


def _file_name(device: dict[str, str]) -> str:
    slug = re.sub(r"[^A-Za-z0-9]+", "-", f"{device.get('name', '')}-sm{device.get('capability', '')}").strip("-")
    digest = hashlib.sha256(json.dumps(device, sort_keys=True).encode()).hexdigest()[:12]
    return f"{slug[:80]}-{digest}.json"


def tuning_file(device: dict[str, str]) -> Path | None:
    """The device's file (its directory created 0700); None, with a warning once, if the directory cannot be
    used safely."""
    try:
        directory = _private_directory(cache_directory() / "tuning", "tuning cache directory")
    except CacheError as err:
        _warn_once(f"ncd: tuning results are not kept on disk: {err}")
        return None
    return directory / _file_name(device)


def _load(path: Path, device: dict[str, str]) -> dict[str, Any]:
    """The file's entries; {} when it is missing, damaged, not private, planted through a link, or another
    device's (then the next write replaces it)."""
    try:
        found = _read_file(path)
        data = json.loads(found[0].decode("utf-8")) if found is not None else None
    except (CacheError, OSError, UnicodeDecodeError, ValueError, RecursionError):
        return {}
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("device") != device:
        return {}
    entries = data.get("entries")
    return entries if isinstance(entries, dict) else {}


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Other processes' read-modify-write of the same file waits (where fcntl exists; else the last write wins,
    which loses a decision, never corrupts one)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    lock = path.with_name(path.name + ".lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def lookup(device: dict[str, str], entry_id: str) -> dict[str, Any] | None:
    path = tuning_file(device)
    if path is None:
        return None
    entry = _load(path, device).get(entry_id)
    return entry if isinstance(entry, dict) else None


def store(device: dict[str, str], entry_id: str, entry: dict[str, Any]) -> Path | None:
    """Add one decision to the device's file (atomically replaced); the file's path, or None if not kept."""
    path = tuning_file(device)
    if path is None:
        return None
    try:
        with _FILE_LOCK, _locked(path):
            entries = _load(path, device)
            entries.pop(entry_id, None)
            entries[entry_id] = entry  # last: the newest
            while len(entries) > MAX_ENTRIES:
                del entries[next(iter(entries))]
            data = {"format": FORMAT, "device": device, "entries": entries}
            _write_atomically(path, (json.dumps(data, indent=1, sort_keys=False) + "\n").encode("utf-8"))
    except OSError as err:
        _warn_once(f"ncd: cannot keep tuning results in {path} ({err.strerror or err}); make its directory "
                   "writable, or set NCD_TUNE_CACHE=0")
        return None
    return path


# --- progress ---------------------------------------------------------------------------------------------------


class Progress:
    """`ncd: tuning LABEL: config i/N` on stderr: redrawn in place on a terminal (tqdm's bar if installed),
    one line per config otherwise; `close` prints the summary line."""

    def __init__(self, label: str, total: int, stream: IO[str] | None = None):
        self.stream = stream if stream is not None else sys.stderr
        self.label, self.total, self.count = label, total, 0
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.bar: Any = None

    def _start_bar(self) -> None:
        try:
            from tqdm import tqdm
        except ImportError:  # not a dependency: the line redrawn with \r does
            return
        self.bar = tqdm(total=self.total, desc=f"ncd: tuning {self.label}", unit="config", file=self.stream,
                        leave=False)

    def step(self, config: Any) -> None:
        self.count += 1
        what = f"config {self.count}/{self.total} ({config_text(config)})"
        if self.tty and self.count == 1:
            self._start_bar()
        if self.bar is not None:
            if self.count > 1:
                self.bar.update(1)
            self.bar.set_postfix_str(config_text(config))
        elif self.tty:
            self.stream.write(f"\rncd: tuning {self.label}: {what}\x1b[K")
        else:
            self.stream.write(f"ncd: tuning {self.label}: {what}\n")
        self.stream.flush()

    def close(self, summary: str) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.tty:
            self.stream.write("\r\x1b[K")
        self.stream.write(summary + "\n")
        self.stream.flush()


# --- the autotuner ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TuningEvent:
    """One tuning decision made in this process: benchmarked, or found on disk (`ncd tune` prints them)."""

    name: str
    key: str
    source: str  # "benchmarked" | "disk"
    config: str
    configs: int  # how many were candidates after pruning
    seconds: float
    best_ms: float | None
    path: Path | None


EVENTS: list[TuningEvent] = []


@dataclass
class _Pending:
    entry_id: str | None  # None: not kept on disk
    device: dict[str, str] | None
    key: TuningKey
    configs: int
    start: float
    progress: Progress


class PersistentAutotuner(Autotuner):
    """Triton's Autotuner, with decisions kept on disk per device and progress shown while benchmarking."""

    def __init__(self, *args: Any, name: str, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.name = name
        fn_name = getattr(self.base_fn, "__name__", "kernel")
        self.label = name if name.rsplit(".", 1)[-1] == fn_name else f"{name}.{fn_name}"
        self._pending: _Pending | None = None
        self._restored: Any = None  # the config found on disk at the last pruning
        self._identity: str | None = None

    def _entry_id(self, key: TuningKey, kwargs: dict[str, Any]) -> str:
        """The decision's key in the device's file: kernel, name, config list, the JIT functions passed (a spec's
        hooks, whether or not `key` names them) and the tuning key."""
        if self._identity is None:
            self._identity = _kernel_identity(self)
        hooks = sorted((k, _plain(v)) for k, v in {**(self.nargs or {}), **kwargs}.items() if _is_jit_function(v))
        identity = {"kernel": self._identity, "name": self.name, "key": key.plain(), "hooks": hooks,
                    "configs": hashlib.sha256("\n".join(map(str, self.configs)).encode()).hexdigest()}
        return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()

    def prune_configs(self, kwargs: dict) -> list:
        pruned = super().prune_configs(kwargs)
        self._restored = None
        if len(pruned) <= 1 or interpreting():
            return pruned
        key = TuningKey.of(self.arg_names, self.keys, self.nargs or {}, kwargs)
        start = time.perf_counter()
        entry_id, device = None, None
        if settings().tune_cache:
            device = device_identity()
            entry_id = self._entry_id(key, kwargs)
            chosen = _match(lookup(device, entry_id), pruned)
            if chosen is not None:
                self._restored = chosen
                EVENTS.append(TuningEvent(self.label, key.text(), "disk", config_text(chosen), len(pruned),
                                          time.perf_counter() - start, None, tuning_file(device)))
                return [chosen]
        progress = Progress(f"{self.label} for key {key.text()}", len(pruned))
        self._pending = _Pending(entry_id, device, key, len(pruned), start, progress)
        return pruned

    def _bench(self, *args: Any, config: Any, **meta: Any) -> Any:
        if self._restored is not None and config is self._restored:  # Triton 3.6 benchmarks a lone pruned config
            return [0.0, 0.0, 0.0]
        if self._pending is not None:
            self._pending.progress.step(config)
        return super()._bench(*args, config=config, **meta)

    def run(self, *args: Any, **kwargs: Any) -> Any:
        self._pending = None  # a warmup() may have pruned without benchmarking
        try:
            result = super().run(*args, **kwargs)
        except BaseException:
            self._finish(ok=False)
            raise
        self._finish(ok=True)
        return result

    def _finish(self, ok: bool) -> None:
        """Close the progress line, keep the decision on disk and record it (after a benchmark only)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        seconds = time.perf_counter() - pending.start
        label = f"{self.label} for key {pending.key.text()}"
        best = getattr(self, "best_config", None)
        timings = getattr(self, "configs_timings", None) or {}
        measured = timings.get(best, math.inf) if best is not None else math.inf
        best_ms = float(measured[0] if isinstance(measured, list | tuple) else measured)  # do_bench: quantiles
        if not ok or best is None or not math.isfinite(best_ms):
            pending.progress.close(f"ncd: tuning {label} failed after {seconds:.1f} s")
            return
        path = None
        desc = config_description(best)
        if pending.entry_id is not None and pending.device is not None and desc is not None:
            path = store(pending.device, pending.entry_id,
                         {"name": self.name, "kernel": self.label, "key": pending.key.text(), "config": desc,
                          "ms": best_ms, "configs": pending.configs, "timings": _timings(timings),
                          "seconds": round(seconds, 3),
                          "saved": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        where = f"; kept in {path}" if path is not None else ""
        pending.progress.close(f"ncd: tuned {label} in {seconds:.1f} s: {config_text(best)} ({best_ms:.3f} ms, "
                               f"best of {pending.configs}){where}")
        EVENTS.append(TuningEvent(self.label, pending.key.text(), "benchmarked", config_text(best), pending.configs,
                                  seconds, best_ms, path))


def _timings(timings: dict) -> dict[str, float | None]:
    """Every benchmarked config's median ms by its text (None: it did not run, e.g. out of shared memory), so that
    the tuning file shows how close the others came."""
    out: dict[str, float | None] = {}
    for config, measured in timings.items():
        ms = float(measured[0] if isinstance(measured, list | tuple) else measured)
        out[config_text(config)] = round(ms, 4) if math.isfinite(ms) else None
    return out


def _match(entry: dict[str, Any] | None, configs: list) -> Any:
    """The config among `configs` whose parameters the stored entry names, else None."""
    wanted = entry.get("config") if entry is not None else None
    if not isinstance(wanted, dict):
        return None
    for config in configs:
        if config_description(config) == wanted:
            return config
    return None


def autotune(configs: list, key: list[str], *, name: str, prune_configs_by: dict | None = None,
             reset_to_zero: list[str] | None = None, restore_value: list[str] | None = None,
             pre_hook: Callable | None = None, post_hook: Callable | None = None, warmup: int | None = None,
             rep: int | None = None, use_cuda_graph: bool = False, do_bench: Callable | None = None,
             cache_results: bool = False) -> Callable[[Any], PersistentAutotuner]:
    """`triton.autotune` with its decisions kept on disk per device and progress on stderr (module docstring).
    `name` says which kernel of which op this is, in messages and in the disk key (e.g. the module's
    `__name__`)."""

    def decorator(fn: Any) -> PersistentAutotuner:
        return PersistentAutotuner(fn, fn.arg_names, configs, key, reset_to_zero, restore_value, name=name,
                                   pre_hook=pre_hook, post_hook=post_hook, prune_configs_by=prune_configs_by,
                                   warmup=warmup, rep=rep, use_cuda_graph=use_cuda_graph, do_bench=do_bench,
                                   cache_results=cache_results)

    return decorator


# --- `ncd tune` -------------------------------------------------------------------------------------------------


class TuneError(Exception):
    """`ncd tune` cannot run as asked (no GPU, a bad --shape); the CLI reports it as a usage error (exit 2)."""


DTYPES = ("bf16", "fp16", "fp32")


def parse_shapes(pairs: list[str]) -> dict[str, int]:
    from .limits import MAX_AXIS_SIZE

    shapes = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        if not name.isidentifier() or not value.isdigit() or len(value) > 10 or not 1 <= int(value) <= MAX_AXIS_SIZE:
            raise TuneError(f"--shape takes AXIS=SIZE with an integer size from 1 to {MAX_AXIS_SIZE}, got {pair!r}")
        shapes[name] = int(value)
    return shapes


def require_gpu() -> None:
    """A TuneError unless kernels compile for a CUDA device here (tuning results are per device)."""
    if interpreting():
        raise TuneError("TRITON_INTERPRET=1 runs kernels in Triton's CPU interpreter, which has nothing to tune: "
                        "unset it and run `ncd tune` on the machine with the GPU that will run the op")
    import torch

    if not torch.cuda.is_available():
        raise TuneError("ncd tune needs a CUDA GPU (torch.cuda.is_available() is False here): tuning results are "
                        "kept per device, so run it on the machine that will run the op")


def tune_spec(spec: str, shape_args: list[str], dtype_name: str = "bf16", backward: bool = True,
              device: str = "cuda", out: IO[str] | None = None) -> list[TuningEvent]:
    """Compile `spec`, run it forward (and backward) once at the given sizes on `device` so that every autotuned
    kernel it launches tunes (and keeps its decision); print what was tuned and how long it took."""
    import torch

    from . import load
    from .validate import random_inputs
    from .validation_forms import forms_for

    out = out if out is not None else sys.stdout
    shapes = parse_shapes(shape_args)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype_name]
    op = load(spec)
    program = op.front.program
    axes = {a.name: a for a in program.axes}
    unknown = sorted(set(shapes) - set(axes))
    if unknown:
        raise TuneError(f"spec {op.name} has no axis {', '.join(unknown)}; its axes are {', '.join(axes)}")
    fixed = {n: s for n, s in shapes.items() if axes[n].fixed is not None and axes[n].fixed != s}
    if fixed:  # a fixed size is compiled into the op: compile it at the asked size
        op = load(spec, sizes=fixed)
        program = op.front.program
    kernel_plan = op.plan
    sizes = {**kernel_plan.validation_sizes(program), **shapes}
    for axis in program.axes:  # aliases and split axes follow the sizes given
        if axis.alias_of is not None and axis.alias_of in shapes and axis.name not in shapes:
            sizes[axis.name] = sizes[axis.alias_of]
        if axis.factors and axis.name not in shapes and any(f in shapes for f in axis.factors):
            sizes[axis.name] = math.prod(sizes[f] for f in axis.factors)
    inputs = random_inputs(op, kernel_plan, sizes, dtype, device)
    inputs = forms_for(op).condition(program, inputs, None)  # families whose inputs have a domain
    constants = kernel_plan.constant_inputs()
    leaves = {n: v.detach().requires_grad_(backward and n not in constants) for n, v in inputs.items()}
    where = device_identity()["name"] if device == "cuda" else device
    print(f"ncd tune: {op.name} at {', '.join(f'{k}={v}' for k, v in sizes.items())} ({dtype_name}) on {where}",
          file=out, flush=True)
    if not settings().tune_cache:
        print("  note: NCD_TUNE_CACHE=0: what is tuned now is not kept for later processes", file=out)
    first = len(EVENTS)

    def timed(what: str, work: Callable[[], Any]) -> Any:
        begin, mark = time.perf_counter(), len(EVENTS)
        result = work()
        if device == "cuda":
            torch.cuda.synchronize()
        print(f"  {what:<9} {time.perf_counter() - begin:7.1f} s", file=out)
        for event in EVENTS[mark:]:
            found = "found on disk" if event.source == "disk" else f"tuned in {event.seconds:.1f} s"
            timing = f", {event.best_ms:.3f} ms" if event.best_ms is not None else ""
            print(f"    {event.name} key {event.key}: {event.config} ({found}, {event.configs} candidates{timing})",
                  file=out)
        return result

    output = timed("forward", lambda: op(*[leaves[t.name] for t in op.signature if t.axes]))
    if backward and getattr(output, "requires_grad", False):
        timed("backward", lambda: output.backward(torch.randn_like(output)))
    events = EVENTS[first:]
    paths = sorted({str(e.path) for e in events if e.path is not None})
    if not events:
        print("  no kernel was autotuned: the op's kernels have one config at these sizes, or were tuned earlier "
              "in this process", file=out)
    for path in paths:
        print(f"  kept in {path}", file=out)
    return events
