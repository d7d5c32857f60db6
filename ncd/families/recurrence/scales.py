"""Gated KalmaNet's key and value scalings of beta (the spec's KEY_SCALE and VALUE_SCALE hooks, kernel.py) applied to
a tensor outside the chunk kernels, differentiably: what torch-side code needs to form kb = k KEY_SCALE(beta) and
vb = v VALUE_SCALE(beta) exactly as the kernels do (the sequence-parallel end states: ncd/distributed.py)."""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _map_kernel(X, OUT, N, F: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    ok = offs < N
    x = tl.load(X + offs, mask=ok, other=1.0).to(tl.float32)
    tl.store(OUT + offs, F(x), mask=ok)


def apply_map(fn: Any, x: torch.Tensor) -> torch.Tensor:
    """fn (a `@triton.jit` function of an fp32 block) applied to every element of x; fp32, x's shape."""
    flat = x.detach().float().contiguous().reshape(-1)
    out = torch.empty_like(flat)
    if flat.numel():
        _map_kernel[(triton.cdiv(flat.numel(), BLOCK),)](flat, out, flat.numel(), F=fn, BLOCK_SIZE=BLOCK)
    return out.reshape(x.shape)


class BetaScales(torch.autograd.Function):
    """(KEY_SCALE(beta), VALUE_SCALE(beta)) in fp32, with the hooks' derivatives (KEY_SCALE_GRAD,
    VALUE_SCALE_GRAD) for beta's gradient."""

    @staticmethod
    def forward(ctx: Any, beta: torch.Tensor, hooks: Any) -> tuple:  # type: ignore[override]
        ctx.save_for_backward(beta)
        ctx.hooks = hooks
        return apply_map(hooks.key_scale, beta), apply_map(hooks.value_scale, beta)

    @staticmethod
    def backward(ctx: Any, d_key: torch.Tensor | None, d_value: torch.Tensor | None) -> tuple:  # type: ignore[override]
        (beta,) = ctx.saved_tensors
        grad = torch.zeros(beta.shape, dtype=torch.float32, device=beta.device)
        if d_key is not None:
            grad = grad + d_key * apply_map(ctx.hooks.key_scale_grad, beta)
        if d_value is not None:
            grad = grad + d_value * apply_map(ctx.hooks.value_scale_grad, beta)
        return grad.to(beta.dtype), None
