"""The L1 / shared-memory split for kernels that spill registers.

Triton asks the driver to prefer shared memory for every kernel holding more than 48 KB of it, and the driver then
gives the SM its largest shared-memory carveout: on an H100, 228 KB of shared memory and about 28 KB of L1. A kernel
that also spills registers then misses L1 on its spill loads and waits on L2 (ncu, the GKA solve: 2.6% L1 hit rate).
`fit_carveout` asks instead for the least shared memory that still holds as many programs per SM as the registers
allow, which leaves the rest to L1: the GKA solve at T = 8192 went from 560 to 506-512 us at r = 10 and from
1,326-1,331 to 1,195-1,199 at r = 30 (H100, bench/log/2026-11-20-to-22.md)."""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from ncd.settings import settings

_RESERVED_SHARED = 1024  # bytes the system keeps per resident program (sm_80 and later)
_CARVEOUT_ATTRIBUTE = 9  # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
_PREFER_NONE = 0  # CU_FUNC_CACHE_PREFER_NONE
_fitted: set[int] = set()


def carveout_percent(shared: int, regs: int, warps: int, shared_per_sm: int, regs_per_sm: int = 65536,
                     threads_per_sm: int = 2048, programs_per_sm: int = 32) -> int:
    """The smallest shared-memory carveout (percent of `shared_per_sm`) that holds as many programs of a kernel
    (`shared` bytes, `regs` registers per thread, `warps` warps) as its registers and threads allow."""
    threads = 32 * warps
    regs_per_program = (regs + 7) // 8 * 8 * threads  # registers are allocated in 8-register steps per thread
    programs = min(regs_per_sm // regs_per_program, threads_per_sm // threads, programs_per_sm,
                   shared_per_sm // (shared + _RESERVED_SHARED))
    return min(100, -(-100 * max(programs, 1) * (shared + _RESERVED_SHARED) // shared_per_sm))


@functools.cache
def _driver() -> Any:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


@functools.cache
def _device_limits(device: int) -> tuple[int, int, int]:
    props = torch.cuda.get_device_properties(device)
    return (props.shared_memory_per_multiprocessor, getattr(props, "regs_per_multiprocessor", 65536),
            props.max_threads_per_multi_processor)


def fit_carveout(kernel: Any) -> Any:
    """Give a just-launched Triton kernel (what `kernel[grid](...)` returns) the carveout of `carveout_percent`
    for its later launches, once, if it spills registers and holds more than 48 KB of shared memory; otherwise,
    under the interpreter, off CUDA or with NCD_FIT_CARVEOUT=0, leave it alone. Returns `kernel`."""
    handle = getattr(kernel, "function", None)
    if not handle or handle in _fitted or getattr(kernel, "n_spills", 0) <= 0 or not settings().fit_carveout:
        return kernel
    _fitted.add(handle)
    meta = kernel.metadata
    driver = _driver()
    if meta.shared <= 48 * 1024 or driver is None or getattr(meta, "target", None) is None \
            or meta.target.backend != "cuda":
        return kernel
    shared_per_sm, regs_per_sm, threads_per_sm = _device_limits(torch.cuda.current_device())
    percent = carveout_percent(meta.shared, kernel.n_regs, meta.num_warps, shared_per_sm, regs_per_sm,
                               threads_per_sm)
    function = ctypes.c_void_p(handle)
    # both calls are hints to the driver (it may still pick another split): their status is not an error of ours
    driver.cuFuncSetCacheConfig(function, ctypes.c_int(_PREFER_NONE))
    driver.cuFuncSetAttribute(function, ctypes.c_int(_CARVEOUT_ATTRIBUTE), ctypes.c_int(percent))
    return kernel
