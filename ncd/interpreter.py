"""The CPU interpreter rounded as the GPU rounds: fp32 -> bf16 to nearest, ties to even.

Triton's interpreter (TRITON_INTERPRET=1, what CI and `ncd check` on the CPU run; its docs call bf16 unsupported)
converts fp32 to bf16 by truncation, and its round-to-nearest branch drops the carry into the exponent (1.9969 ->
1.0). The GPU rounds to nearest even (`cvt.rn.bf16.f32`). Truncation biases every rounded P and O towards zero, and
the bias, amplified by 1/b(z) in the backward's delta, failed bf16 checks that the GPU passes (measured:
sliding_window_spherical's bf16 dQ at `ncd check --seed 1`, 3.8e-2 truncated, 2.7e-3 rounded; bench/log/
2026-11-26-issue32-s6.md). `round_bf16_to_nearest` (called by ncd/launch.py, which every kernel module imports)
replaces that one conversion of the interpreter's builder; a Triton without the method it wraps is left alone
(tests/test_interpreter_rounding.py then fails).

`skip_repeated_patching` (also called by ncd/launch.py) removes a cost, not a behaviour: the interpreter patches
triton.language again at every call of a @triton.jit helper inside a kernel, about 1 ms each, half the CPU time of
Gated KalmaNet's kernels (one forward and backward at T 53: 12.1 s, then 6.3 s).
"""

from __future__ import annotations

from typing import Any

import numpy as np


def bf16_bits(values: Any) -> np.ndarray:
    """The bf16 bit patterns (uint16) of float32 `values`, rounded to nearest even; NaN stays a (quiet) NaN."""
    data = np.asarray(values, dtype=np.float32)
    bits = data.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(data), (bits >> 16).astype(np.uint16) | np.uint16(0x40), rounded)


def round_bf16_to_nearest() -> bool:
    """Make the interpreter's fp32 -> bf16 casts round to nearest even (idempotent); False where this Triton has no
    interpreter builder to patch."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - a Triton without the interpreter
        return False
    builder = getattr(interpreter, "InterpreterBuilder", None)
    handle = getattr(interpreter, "TensorHandle", None)
    if builder is None or handle is None or not hasattr(builder, "cast_impl") or not hasattr(interpreter, "_ir"):
        return False
    if getattr(builder.cast_impl, "ncd_rounds_bf16", False):
        return True
    truncating = builder.cast_impl
    to_fp = builder.create_fp_to_fp
    rtz = interpreter._ir.ROUNDING_MODE.RTZ  # the one mode asked for by name that keeps truncating

    def cast_impl(self: Any, src: Any, dst_type: Any) -> Any:
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return handle(bf16_bits(src.data), dst_type.scalar)
        return truncating(self, src, dst_type)

    def create_fp_to_fp(self: Any, src: Any, dst_type: Any, rounding_mode: Any) -> Any:
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16 and rounding_mode != rtz:
            return handle(bf16_bits(src.data), dst_type.scalar)
        return to_fp(self, src, dst_type, rounding_mode)

    cast_impl.ncd_rounds_bf16 = True  # type: ignore[attr-defined]
    builder.cast_impl = cast_impl
    builder.create_fp_to_fp = create_fp_to_fp
    return True


def skip_repeated_patching() -> bool:
    """Skip the interpreter's patching of triton.language at a helper's call when the kernel's launch has already
    patched the modules the helper sees (their builtins are no longer builtins): the call would patch nothing new
    (idempotent); False where this Triton has no such step."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - a Triton without the interpreter
        return False
    original = getattr(interpreter, "_patch_lang", None)
    if original is None or not hasattr(interpreter, "_LangPatchScope"):
        return False
    if getattr(original, "ncd_skips_repeats", False):
        return True

    def patch_lang(fn: Any) -> Any:
        langs = [value for value in fn.__globals__.values() if value is tl or value is tl.core]
        if langs and not any(tl.core.is_builtin(lang.dot) for lang in langs):
            return interpreter._LangPatchScope()
        return original(fn)

    patch_lang.ncd_skips_repeats = True  # type: ignore[attr-defined]
    interpreter._patch_lang = patch_lang
    return True
