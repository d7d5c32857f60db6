"""Direct launches of compiled Triton kernels, for the generated modules.

The first call of a kernel at a specialisation goes through Triton (autotuning, JIT compile or its cache); later
calls at the same specialisation call the compiled kernel's launcher themselves, with the arguments Triton would
pass. That skips the autotuner's key and config lookup and the JIT's argument binding and specialisation: the
attention op's backward spent about 0.4-0.6 ms of host time in three or four such launches (bench/host.py).

Two launchers share that mechanism:
- `FastKernel` keys each call itself, stricter than Triton's specialisation: every int argument by value, every
  tensor by dtype, device and 16-byte alignment, every descriptor by those and its shape and strides, the
  constexprs and launch options. A call whose key was seen therefore has the same compiled kernel, the same
  autotuned config and the same grid function result shape.
- `BoundKernel` is one kernel at one specialisation that its caller fixes and keys (grid, constexprs, launch
  options; the caller's plan covers what Triton would specialise on), so a call costs no key at all.

`why` says why a kernel stays on Triton's path."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from .interpreter import round_bf16_to_nearest, skip_repeated_patching
from .settings import settings

# every kernel module imports this one: the CPU interpreter's bf16 casts rounded as the GPU's, and its repeated
# patching skipped (interpreter.py); not at `import ncd`, which must not import Triton (TRITON_INTERPRET is read when
# the first kernel module loads)
round_bf16_to_nearest()
skip_repeated_patching()


def _descriptor_type() -> type | None:
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # pragma: no cover - Triton < 3.3
        return None
    return TensorDescriptor


def _jit_function_type() -> type:
    from triton.runtime.jit import JITFunction

    return JITFunction


def _runtime_knobs() -> Any:
    import triton

    return getattr(getattr(triton, "knobs", None), "runtime", None)


def _driver() -> Any:
    from triton.runtime import driver

    return driver


_DESCRIPTOR: Any = _descriptor_type()
_RUNTIME = _runtime_knobs()
_JIT_FUNCTION: Any = _jit_function_type()
_DRIVER = _driver()
_COMPILED_ATTRS = ("run", "function", "packed_metadata", "launch_metadata")
MAX_ENTRIES = 1024  # specialisations one FastKernel remembers


def _current_device() -> int:
    """The device Triton's JIT launches on (its current device, not the arguments')."""
    return _DRIVER.active.get_current_device()


def _current_stream(device: int) -> int:
    return _DRIVER.active.get_current_stream(device)


def _arg_names(kernel: Any) -> tuple:
    """The kernel's parameter names: a JIT function's, or those of the JIT function an autotuner wraps (a JIT
    function's own `fn` is the plain Python function)."""
    while kernel is not None and not hasattr(kernel, "arg_names"):
        kernel = getattr(kernel, "fn", None)
    return tuple(getattr(kernel, "arg_names", ()))


def _enabled(enabled: bool | None) -> bool:
    if enabled is None:  # the CPU interpreter has no compiled kernels to call
        return settings().fast_launch and os.environ.get("TRITON_INTERPRET", "0") != "1"
    return enabled


_PLAIN = frozenset({int, bool, str, type(None)})  # keyed by value (str: a constexpr such as a precision)
_PARAMETER = torch.nn.Parameter


def _key_of(arg: Any) -> Any:
    """What of one argument the compiled kernel may depend on (NotImplemented: an argument not understood).
    Exact type tests first: this runs for every argument of every launch (GKA's backward: about 200 a call)."""
    kind = type(arg)
    if kind in _PLAIN:
        return arg
    if kind is torch.Tensor or kind is _PARAMETER:
        return arg.dtype, arg.get_device(), arg.data_ptr() & 15 == 0
    if kind is tuple:  # a tuple argument (e.g. a rational op's parameters): Triton specialises each member
        if set(map(type, arg)) <= _PLAIN:  # ints (strides): each its own key, found without a call per member
            return tuple, arg
        keys = tuple(map(_key_of, arg))
        return NotImplemented if NotImplemented in keys else (tuple, keys)
    if kind is float:
        return float
    if hasattr(arg, "data_ptr"):  # another tensor subclass
        return arg.dtype, arg.get_device(), arg.data_ptr() & 15 == 0
    if isinstance(arg, int | str):
        return arg
    if _DESCRIPTOR is not None and isinstance(arg, _DESCRIPTOR):
        base = arg.base
        return (base.dtype, base.get_device(), base.data_ptr() & 15 == 0, tuple(arg.shape), tuple(arg.strides),
                arg.padding)
    return NotImplemented


def _kwargs_key(kwargs: dict) -> tuple:
    """The constexprs and options as a key. A @triton.jit function (a spec's hook) is keyed by identity: its own
    hash is a hash of its source key, about 0.5 us each, and hooks made 14 of them a launch (bench/log/
    2026-11-26-issue31.md). An identity cannot be reused while the entry lives: the entry's `meta` holds the
    function."""
    return tuple(kwargs), tuple([(_JIT_FUNCTION, id(v)) if type(v) is _JIT_FUNCTION else v for v in kwargs.values()])


def _why_not_direct(kernel: Any, compiled: Any, n_positional: int, constexprs: dict) -> str:
    """Why `compiled` (what `kernel[grid](...)` returned) cannot be launched directly ("direct": it can), as
    Triton's JIT launches it: grid, stream, function, metadata, launch hooks, every parameter."""
    names = _arg_names(kernel)
    if compiled is None or not all(hasattr(compiled, a) for a in _COMPILED_ATTRS):
        return f"unexpected compiled-kernel object {type(compiled).__name__}"
    if sorted(names[n_positional:]) != sorted(constexprs):
        return "the constexprs are not exactly the parameters after the positional arguments"
    if _RUNTIME is None:
        return "no triton.knobs.runtime (launch hooks unknown)"
    return "direct"


class FastKernel:
    """`FastKernel(kernel)[grid](*args, **constexprs_and_options)` launches a @triton.jit or @triton.autotune
    kernel as `kernel[grid](...)` does, directly from the second call at each specialisation. Positional arguments
    are the kernel's leading parameters; every constexpr (the autotuned ones aside) and launch option (num_warps,
    num_stages, ...) is passed by name."""

    __slots__ = ("cache", "enabled", "kernel", "names", "why")

    def __init__(self, kernel: Any, enabled: bool | None = None):
        self.kernel = kernel
        self.names = _arg_names(kernel)
        self.enabled = _enabled(enabled)
        self.cache: dict = {}
        self.why = "not launched yet"

    def __getitem__(self, grid: Callable | tuple) -> Callable:
        return lambda *args, **kwargs: self.launch(grid, *args, **kwargs)

    def launch(self, grid: Callable | tuple, *args: Any, **kwargs: Any) -> Any:
        if not self.enabled:
            return self.kernel[grid](*args, **kwargs)
        device = _current_device()
        arg_keys = tuple(map(_key_of, args))
        # _kwargs_key, inline (host time per launch)
        key = (device, arg_keys, (tuple(kwargs), tuple([(_JIT_FUNCTION, id(v)) if type(v) is _JIT_FUNCTION else v
                                                        for v in kwargs.values()]))) \
            if NotImplemented not in arg_keys else None
        hit = self.cache.get(key) if key is not None else None
        if hit is None:
            compiled = self.kernel[grid](*args, **kwargs)
            if key is not None:
                self._remember(key, compiled, args, kwargs)
            return compiled
        compiled, meta, tail, hook = hit
        if hook is not None:  # e.g. the TMA descriptors' tile for the tuned config
            hook({**dict(zip(self.names, args, strict=False)), **meta})
        g = (*(grid(meta) if callable(grid) else grid), 1, 1)
        # as Triton's JIT launches (inline: host time per launch)
        runtime = _RUNTIME
        enter = runtime.launch_enter_hook
        stream = _current_stream(device)
        launch_meta = compiled.launch_metadata(g[:3], stream, *args, *tail) if enter is not None else None
        compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata, launch_meta, enter,
                     runtime.launch_exit_hook, *args, *tail)
        return compiled

    def _remember(self, key: tuple, compiled: Any, args: tuple, kwargs: dict) -> None:
        config = getattr(self.kernel, "best_config", None)  # set by the autotuner's run
        constexprs = {k: v for k, v in kwargs.items() if k in self.names}  # the rest are options (num_warps)
        meta = {**constexprs, **(config.kwargs if config is not None else {})}
        self.why = _why_not_direct(self.kernel, compiled, len(args), meta)
        if self.why == "direct":
            if len(self.cache) >= MAX_ENTRIES:  # ints are keyed by value: a stream of new shapes must not pile up
                self.cache.clear()
            tail = tuple(meta[name] for name in self.names[len(args):])
            self.cache[key] = (compiled, meta, tail, config.pre_hook if config is not None else None)


_SMS: dict[int, int] = {}


def sm_count(device: torch.device | None, off_gpu: int) -> int:
    """Streaming multiprocessors of CUDA `device` (None: the current one), queried once per device (the property
    call is not free); `off_gpu` where kernels do not run on a GPU (the CPU interpreter), each caller's choice of
    what its tests should exercise."""
    if (device is not None and device.type != "cuda") or not torch.cuda.is_available():
        return off_gpu
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


_LAUNCHERS: dict = {}


def fast(kernel: Any) -> FastKernel:
    """`fast(kernel)[grid](...)`: the one FastKernel of `kernel`, so that what it learnt lives as long as the
    kernel does (NCD_FAST_LAUNCH=0 turns direct launches off)."""
    launcher = _LAUNCHERS.get(kernel)
    if launcher is None:
        launcher = _LAUNCHERS[kernel] = FastKernel(kernel)
    return launcher


def forget(kernel: Any) -> None:
    """Drop `kernel`'s direct launches, e.g. after replacing its autotune configs."""
    _LAUNCHERS.pop(kernel, None)


class BoundKernel:
    """`BoundKernel(kernel, grid, constexprs, num_warps=, num_stages=)(stream, *args)`: one @triton.jit kernel at
    one specialisation that the caller fixes. The caller keys its BoundKernels on whatever Triton specialises on
    (int values, dtypes, alignment), so a call computes no key. A first launch over the device's shared memory
    retries with one pipeline stage less."""

    __slots__ = ("compiled", "constexprs", "enabled", "grid", "kernel", "names", "options", "tail", "why")

    def __init__(self, kernel: Any, grid: tuple, constexprs: dict, num_warps: int = 4, num_stages: int = 1,
                 enabled: bool | None = None):
        self.kernel = kernel
        self.grid = (*grid, 1, 1)[:3]
        self.names = _arg_names(kernel)
        self.constexprs = constexprs
        self.tail: tuple = ()
        self.options = {"num_warps": num_warps, "num_stages": num_stages}
        self.enabled = _enabled(enabled)
        self.compiled: Any = None
        self.why = "not launched yet"

    def __call__(self, stream: int, *args: Any) -> None:
        compiled = self.compiled
        if compiled is not None:  # as Triton's JIT launches (inline: host time per launch)
            runtime = _RUNTIME
            enter = runtime.launch_enter_hook
            grid = self.grid
            meta = compiled.launch_metadata(grid, stream, *args, *self.tail) if enter is not None else None
            compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata, meta, enter,
                         runtime.launch_exit_hook, *args, *self.tail)
            return
        try:
            compiled = self.kernel[self.grid](*args, **self.constexprs, **self.options)
        except Exception as err:  # shared memory over the device's limit: one pipeline stage less
            if type(err).__name__ != "OutOfResources" or self.options["num_stages"] <= 1:
                raise
            self.options["num_stages"] -= 1
            return self(stream, *args)
        self.why = _why_not_direct(self.kernel, compiled, len(args), self.constexprs) if self.enabled else "disabled"
        if self.why == "direct":
            self.tail = tuple(self.constexprs[name] for name in self.names[len(args):])
            self.compiled = compiled
