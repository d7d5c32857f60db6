"""The interpreter's fp32 -> bf16 casts round as the GPU's (ncd/interpreter.py), bit for bit against torch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import ncd.launch  # noqa: F401  (the kernel modules' import of it installs the rounding)
from ncd.interpreter import bf16_bits, round_bf16_to_nearest

EDGES = [1 + 0.75 * 2**-7, 1 + 0.25 * 2**-7, 1 + 0.5 * 2**-7, 1 + 1.5 * 2**-7, 1.9968703, -1.9968703, 0.0, -0.0,
         3.3895314e38, 3.4028235e38, float("inf"), float("-inf"), 1e-40, -1e-40, 2.0**-133]


@triton.jit
def _cast(X, Y, N, BLOCK: tl.constexpr, EXPLICIT: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < N)
    if EXPLICIT:  # noqa: SIM108 (a constexpr branch: each variant compiles one cast)
        y = x.to(tl.bfloat16, fp_downcast_rounding="rtne")
    else:
        y = x.to(tl.bfloat16)
    tl.store(Y + offs, y, mask=offs < N)


def _values() -> torch.Tensor:
    draws = torch.randn(3001, generator=torch.Generator().manual_seed(0)) * torch.logspace(-30, 30, 3001)
    return torch.cat([torch.tensor(EDGES, dtype=torch.float32), draws.float()])


def test_kernel_casts_round_to_nearest_even_as_torch_does():
    x = _values()
    want = x.to(torch.bfloat16).view(torch.int16)
    for explicit in (False, True):
        y = torch.full(x.shape, float("nan"), dtype=torch.bfloat16)
        _cast[(triton.cdiv(x.numel(), 512),)](x, y, x.numel(), BLOCK=512, EXPLICIT=explicit)
        assert torch.equal(y.view(torch.int16), want), (explicit, (y.view(torch.int16) != want).sum())


def test_bit_rounding_keeps_nan_a_nan_and_is_idempotent():
    x = _values()
    assert torch.equal(torch.from_numpy(bf16_bits(x.numpy()).view("int16")), x.to(torch.bfloat16).view(torch.int16))
    nan = torch.from_numpy(bf16_bits([float("nan"), -float("nan")]).view("int16")).view(torch.bfloat16)
    assert torch.isnan(nan.float()).all()
    assert round_bf16_to_nearest() and round_bf16_to_nearest()


@triton.jit
def _twice(x):
    return x + x


@triton.jit
def _helpers(X, Y, N, CALLS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < N, other=0.0)
    for _ in tl.static_range(CALLS):
        x = _twice(x) * 0.5
    tl.store(Y + offs, x + tl.sum(x, 0), mask=offs < N)


def test_helper_calls_inside_a_kernel_patch_the_language_once_and_compute_the_same(monkeypatch):
    """skip_repeated_patching (ncd/interpreter.py): a kernel calling a helper 1 or 8 times patches
    triton.language as often (at its launch), and computes what it did."""
    from triton.runtime import interpreter

    from ncd.interpreter import skip_repeated_patching

    assert skip_repeated_patching() and getattr(interpreter._patch_lang, "ncd_skips_repeats", False)
    calls = []
    patch_builtin = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda *a: calls.append(1) or patch_builtin(*a))
    x = torch.randn(37, generator=torch.Generator().manual_seed(0))
    counts = []
    for n_calls in (1, 1, 8):  # the first launch may patch a module the first time (tl.sum's), once per process
        y = torch.full_like(x, float("nan"))
        calls.clear()
        _helpers[(1,)](x, y, 37, CALLS=n_calls, BLOCK=64)
        counts.append(len(calls))
        assert torch.allclose(y, x + x.sum(), rtol=1e-6, atol=1e-5)
    assert counts[1] == counts[2] > 0, counts
