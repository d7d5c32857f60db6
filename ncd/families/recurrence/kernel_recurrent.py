"""Token-by-token Gated KalmaNet for decoding: the recurrence itself, no chunking, in two launches. `_solve_kernel`
(one program per (sequence, head), H in registers across the tokens of the call) updates H and solves for each
token's qa = q + alpha (x - q); `_readout_kernel` (one program per (sequence, head, block of 64 value columns))
updates S and reads o out with qa. It computes what the chunked kernels (kernel.py) compute, with the same hooks
(KEY_SCALE, VALUE_SCALE of beta) and the same Chebyshev iteration (`_chebyshev`'s step d_i, omega_0 = 2,
step0 = 2 / (L + mu)), so prefill by `chunk` and decoding by `recurrent` agree to fp32 rounding. Inference only: no
backward.
Why two launches: with both states in one program's registers the step spilled (255 registers), one program fitted
per SM, and S's traffic waited on the latency-bound solve. Split, S's update moves its bytes at the rate of a copy,
and the solve holds H alone (H100, B 32, H 16, D 128, one token: 100 -> 76 us at r 10, 212 -> 117 us at r 30;
bench/log/2026-11-27-issue33-s7.md).

recurrent(config, hooks, q, k, v, g, gk, beta, alpha, h_init, s_init, scale, ridge, ridge_offset, num_iter)
    -> (o, h_fin, s_fin)
q, k [B, T, H, K], v [B, T, H, V], g, gk, beta, alpha [B, T, H] (T: a few tokens, typically one; g gates S, gk H,
gk None: g both); states fp32
(H [B, H, K, K], S [B, H, K, V], fla's layout), None for zero states.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from ncd.launch import fast as _fast


@triton.jit
def _solve_kernel(q_ptr, k_ptr, g_ptr, beta_ptr, alpha_ptr, h_ptr, h_out_ptr, qa_ptr, ridge, ridge_offset, rho2,
                  n_iter, T, H, K, HAS_BETA: tl.constexpr, HAS_ALPHA: tl.constexpr, HAS_INIT: tl.constexpr,
                  TOKEN_RHO: tl.constexpr, BK: tl.constexpr, KEY_SCALE: tl.constexpr):
    """H's update and the per-token solve: qa_t = q_t + alpha_t (x_t - q_t), x_t ~ (H_t + lam_t I)^-1 q_t."""
    bh = tl.program_id(0)
    b = bh // H
    head = bh % H
    ck = tl.arange(0, BK)
    k_ok = ck < K
    hh_at = bh.to(tl.int64) * K * K + ck[:, None] * K + ck[None, :]
    hh_ok = k_ok[:, None] & k_ok[None, :]
    if HAS_INIT:
        state_h = tl.load(h_ptr + hh_at, mask=hh_ok, other=0.0).to(tl.float32)
    else:
        state_h = tl.zeros([BK, BK], dtype=tl.float32)
    one = tl.zeros([1], dtype=tl.int32)
    for t in range(T):
        tok = (b.to(tl.int64) * T + t) * H + head
        q = tl.load(q_ptr + tok * K + ck, mask=k_ok, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + tok * K + ck, mask=k_ok, other=0.0).to(tl.float32)
        decay_h = tl.exp(tl.load(g_ptr + tok + one).to(tl.float32))
        if HAS_BETA:  # noqa: SIM108 (a constexpr branch)
            bt = tl.load(beta_ptr + tok + one).to(tl.float32)
        else:
            bt = tl.full([1], 1.0, tl.float32)
        kb = k * KEY_SCALE(bt)
        state_h = decay_h[:, None] * state_h + kb[:, None] * kb[None, :]
        norm = tl.sqrt(tl.sum(tl.sum(state_h * state_h, 1), 0))
        if TOKEN_RHO:  # a ridge offset: mu = lam > 0, and the rate is this token's (as kernel.py's _solve)
            lam = ridge * norm + ridge_offset
            step0 = 2.0 / (norm + 2.0 * lam)  # 2 / (L + mu)
            rate = norm * (0.5 * step0)
            rates = rate * rate
        else:
            lam = ridge * norm
            step0 = 2.0 / (tl.where(norm > 0, norm, 1.0) * (1.0 + 2.0 * ridge))  # 2 / (L + mu)
            rates = rho2
        x = step0 * q
        d = x
        omega = rates * 0.0 + 2.0  # a tensor from the start: the loop carries one type
        for _ in range(n_iter):
            omega = 4.0 / (4.0 - rates * omega)
            step = (omega - 1.0) * d - step0 * omega * (tl.sum(state_h * x[None, :], 1) + lam * x - q)
            x = x + step
            d = step
        if HAS_ALPHA:  # noqa: SIM108 (a constexpr branch)
            qa = q + tl.load(alpha_ptr + tok + one).to(tl.float32) * (x - q)
        else:
            qa = x
        tl.store(qa_ptr + tok * K + ck, qa, mask=k_ok)
    tl.store(h_out_ptr + hh_at, state_h, mask=hh_ok)


@triton.jit
def _readout_kernel(qa_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s_ptr, o_ptr, s_out_ptr, scale, T, H, K, V,
                    HAS_BETA: tl.constexpr, HAS_INIT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                    KEY_SCALE: tl.constexpr, VALUE_SCALE: tl.constexpr):
    """S's update and the read-out o_t = scale S_t^T qa_t, for one block of S's columns."""
    bh = tl.program_id(0)
    b = bh // H
    head = bh % H
    ck = tl.arange(0, BK)
    cv = tl.program_id(1) * BV + tl.arange(0, BV)
    k_ok, v_ok = ck < K, cv < V
    hs_at = bh.to(tl.int64) * K * V + ck[:, None] * V + cv[None, :]
    hs_ok = k_ok[:, None] & v_ok[None, :]
    if HAS_INIT:
        state_s = tl.load(s_ptr + hs_at, mask=hs_ok, other=0.0).to(tl.float32)
    else:
        state_s = tl.zeros([BK, BV], dtype=tl.float32)
    one = tl.zeros([1], dtype=tl.int32)
    for t in range(T):
        tok = (b.to(tl.int64) * T + t) * H + head
        qa = tl.load(qa_ptr + tok * K + ck, mask=k_ok, other=0.0)
        k = tl.load(k_ptr + tok * K + ck, mask=k_ok, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + tok * V + cv, mask=v_ok, other=0.0).to(tl.float32)
        decay = tl.exp(tl.load(g_ptr + tok + one).to(tl.float32))
        if HAS_BETA:  # noqa: SIM108 (a constexpr branch)
            bt = tl.load(beta_ptr + tok + one).to(tl.float32)
        else:
            bt = tl.full([1], 1.0, tl.float32)
        state_s = decay[:, None] * state_s + (k * KEY_SCALE(bt))[:, None] * (v * VALUE_SCALE(bt))[None, :]
        o = scale * tl.sum(state_s * qa[:, None], 0)
        tl.store(o_ptr + tok * V + cv, o.to(o_ptr.dtype.element_ty), mask=v_ok)
    tl.store(s_out_ptr + hs_at, state_s, mask=hs_ok)


def recurrent(config: Any, hooks: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
              gk: torch.Tensor | None, beta: torch.Tensor | None, alpha: torch.Tensor | None,
              h_init: torch.Tensor | None, s_init: torch.Tensor | None, scale: float, ridge: float,
              ridge_offset: float, num_iter: int) -> tuple:
    """o [B, T, H, V] in v's dtype and the states after the last token (fp32)."""
    B, T, heads, K = q.shape
    V = v.shape[3]
    q, k, v, g = (t.contiguous() for t in (q, k, v, g))
    gk = gk.contiguous() if gk is not None else g  # H's gate
    beta = beta.contiguous() if beta is not None else None
    alpha = alpha.contiguous() if alpha is not None else None
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if config.poison_outputs:
        o.fill_(float("nan"))
    h_fin = torch.empty((B, heads, K, K), dtype=torch.float32, device=q.device)
    s_fin = torch.empty((B, heads, K, V), dtype=torch.float32, device=q.device)
    states = (h_init.contiguous(), s_init.contiguous()) if h_init is not None and s_init is not None else None
    has_init = states is not None
    BK = triton.next_power_of_2(K)
    qa = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    _fast(_solve_kernel)[(B * heads,)](
        q, k, gk, beta if beta is not None else g, alpha if alpha is not None else g,
        states[0] if states else h_fin, h_fin, qa, float(ridge), float(ridge_offset),
        float(hooks.rho(float(ridge))) ** 2 if ridge_offset == 0 else 0.0, int(num_iter), T, heads, K,
        HAS_BETA=beta is not None, HAS_ALPHA=alpha is not None, HAS_INIT=has_init, TOKEN_RHO=ridge_offset > 0, BK=BK,
        KEY_SCALE=hooks.key_scale, num_warps=4)
    BV = min(64, triton.next_power_of_2(V))
    _fast(_readout_kernel)[(B * heads, triton.cdiv(V, BV))](
        qa, k, v, g, beta if beta is not None else g, states[1] if states else s_fin, o, s_fin, float(scale), T,
        heads, K, V, HAS_BETA=beta is not None, HAS_INIT=has_init, BK=BK, BV=BV, KEY_SCALE=hooks.key_scale,
        VALUE_SCALE=hooks.value_scale, num_warps=4)
    return o, h_fin, s_fin
