"""Direct launches of compiled Triton kernels, for the generated modules.

The first call of a kernel at a specialisation goes through Triton (autotuning, JIT compile or its cache); later
calls at the same specialisation call the compiled kernel's launcher themselves, with the arguments Triton would
pass. That skips the autotuner's key and config lookup and the JIT's argument binding and specialisation: the
attention op's backward spent about 0.4-0.6 ms of host time in three or four such launches (bench/host.py).

The cache key is stricter than Triton's specialisation: every int argument by value, every tensor by dtype, device
and 16-byte alignment, every descriptor by those and its shape and strides, and the constexprs. A call whose key
was seen therefore has the same compiled kernel, the same autotuned config and the same grid function result
shape. `why` says why a kernel stays on Triton's path."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from .settings import settings


def _descriptor_type() -> type | None:
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # pragma: no cover - Triton < 3.3
        return None
    return TensorDescriptor


def _runtime_knobs() -> Any:
    import triton

    return getattr(getattr(triton, "knobs", None), "runtime", None)


def _current_device() -> int:
    """The device Triton's JIT launches on (its current device, not the arguments')."""
    from triton.runtime import driver

    return driver.active.get_current_device()


def _current_stream(device: int) -> int:
    from triton.runtime import driver

    return driver.active.get_current_stream(device)


_DESCRIPTOR: Any = _descriptor_type()
_RUNTIME = _runtime_knobs()
_COMPILED_ATTRS = ("run", "function", "packed_metadata", "launch_metadata")


def _key_of(arg: Any) -> Any:
    """What of one argument the compiled kernel may depend on (NotImplemented: an argument not understood)."""
    if arg is None or isinstance(arg, int | str):  # bool is an int; str: a constexpr such as a precision
        return arg
    if isinstance(arg, float):
        return float
    if hasattr(arg, "data_ptr"):
        return arg.dtype, arg.device, arg.data_ptr() % 16 == 0
    if _DESCRIPTOR is not None and isinstance(arg, _DESCRIPTOR):
        base = arg.base
        return (base.dtype, base.device, base.data_ptr() % 16 == 0, tuple(arg.shape), tuple(arg.strides),
                arg.padding)
    return NotImplemented


class FastKernel:
    """`FastKernel(kernel)[grid](*args, **constexprs)` launches a @triton.jit or @triton.autotune kernel as
    `kernel[grid](...)` does, directly from the second call at each specialisation. Positional arguments are the
    kernel's leading parameters; every constexpr (the autotuned ones aside) is passed by name."""

    __slots__ = ("cache", "enabled", "kernel", "names", "why")

    def __init__(self, kernel: Any, enabled: bool | None = None):
        self.kernel = kernel
        jit = getattr(kernel, "fn", kernel)  # an autotuner wraps the JIT function
        self.names = tuple(getattr(jit, "arg_names", ()))
        if enabled is None:  # the CPU interpreter has no compiled kernels to call
            enabled = settings().fast_launch and os.environ.get("TRITON_INTERPRET", "0") != "1"
        self.enabled = enabled
        self.cache: dict = {}
        self.why = "not launched yet"

    def __getitem__(self, grid: Callable | tuple) -> Callable:
        return lambda *args, **constexprs: self.launch(grid, *args, **constexprs)

    def launch(self, grid: Callable | tuple, *args: Any, **constexprs: Any) -> Any:
        if not self.enabled:
            return self.kernel[grid](*args, **constexprs)
        device = _current_device()
        key = self._key(device, args, constexprs)
        hit = self.cache.get(key) if key is not None else None
        if hit is None:
            compiled = self.kernel[grid](*args, **constexprs)
            if key is not None:
                self._remember(key, compiled, args, constexprs)
            return compiled
        stream = _current_stream(device)
        compiled, meta, tail, hook = hit
        if hook is not None:  # e.g. the TMA descriptors' tile for the tuned config
            hook({**dict(zip(self.names, args, strict=False)), **meta})
        g = (*(grid(meta) if callable(grid) else grid), 1, 1)
        runtime = _RUNTIME
        enter = runtime.launch_enter_hook if runtime is not None else None
        leave = runtime.launch_exit_hook if runtime is not None else None
        launch_meta = compiled.launch_metadata(g[:3], stream, *args, *tail) if enter is not None else None
        compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata, launch_meta, enter, leave,
                     *args, *tail)
        return compiled

    def _key(self, device: int, args: tuple, constexprs: dict) -> tuple | None:
        key = tuple(_key_of(a) for a in args)
        if NotImplemented in key:
            return None
        return device, key, tuple(constexprs.items())

    def _remember(self, key: tuple, compiled: Any, args: tuple, constexprs: dict) -> None:
        config = getattr(self.kernel, "best_config", None)  # set by the autotuner's run
        meta = {**constexprs, **(config.kwargs if config is not None else {})}
        trailing = self.names[len(args):]
        if compiled is None or not all(hasattr(compiled, a) for a in _COMPILED_ATTRS):
            self.why = f"unexpected compiled-kernel object {type(compiled).__name__}"
        elif sorted(trailing) != sorted(meta):
            self.why = "the constexprs are not exactly the parameters after the positional arguments"
        elif _RUNTIME is None:
            self.why = "no triton.knobs.runtime (launch hooks unknown)"
        else:
            tail = tuple(meta[name] for name in trailing)
            self.cache[key] = (compiled, meta, tail, config.pre_hook if config is not None else None)
            self.why = "direct"
