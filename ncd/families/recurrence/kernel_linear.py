"""Chunked gated linear attention with a scalar gate per head and token (simple GLA; RetNet; Mamba-2's SSD
recurrence): forward, backward and decoding kernels, the same for every spec of that form.

The recurrence, per (sequence, head), t along time, S [key, value] (fla's layout; the spec's S transposed):
    S_t = exp(g_t) S_(t-1) + k_t v_t^T,   o_t = scale S_t^T q_t.
Chunked form (chunk C; G = cumulative log gate inside the chunk, Gc its total; D_ts = exp(G_t - G_s) [s <= t]):
    states:  S_(c+1) = exp(Gc) S_c + (k o exp(Gc - G))^T v                (sequential over chunks: _scan)
    output:  o = scale ((q o exp(G)) S_c + ((q k^T) o D) v)                  (parallel over chunks: _output)
Backward (dS_c: the gradient of the state after chunk c, dS_N that of the final state):
    dS_(c-1) = exp(Gc) dS_c + scale (q o exp(G))^T do                      (_scan again, reversed)
    dq = scale (exp(G) o do S_c^T + ((do v^T) o D) k),  dk = exp(Gc - G) o v dS_c^T + scale ((do v^T) o D)^T q,
    dv = scale ((q k^T) o D)^T do + exp(Gc - G) o k dS_c                    (_grads, parallel over chunks)
    dg_t = sum over s >= t in the sequence of (q_s . dq_s - k_s . dk_s), plus <S_T, dS_T> (every exponent
    exp(G_a - G_b) pairs a reader a, a query or the final state, with a writer b, a key).
Every exponent is of a difference G_t - G_s with s <= t inside one chunk, or of a chunk's partial or full total:
never positive, so nothing overflows whatever the gates. Products multiply the inputs' 16-bit values (and the
weighted operands rounded to them, as fla does) or, for fp32 inputs, tf32x3 ones; accumulation is fp32.

forward(config, q, k, v, g, s_init, cu_seqlens, scale, chunk, final) -> (o, s_fin)
backward(config, do, ds_fin, q, k, v, g, s_init, cu_seqlens, scale, chunk) -> (dq, dk, dv, dg, ds_init)
recurrent(config, q, k, v, g, s_init, scale) -> (o, s_fin): decoding, token by token from a state.
q [B, T, H, K], k [B, T, H / G, K], v [B, T, H / G, V] (G query heads share a key/value head: GQA), g [B, T, H];
states [N, H, K, V] fp32 (one per query head: the gates are); cu_seqlens packs N sequences into B = 1.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from ncd.families.recurrence.kernel import (
    _INTERPRET,
    _decay_mask,
    _dot,
    _empty,
    _load_cols,
    _load_rows_raw,
    _pow2,
    _reverse_cumsum,
    _sequence,
    _work,
    chunk_table,
)
from ncd.launch import fast as _fast
from ncd.tuning import autotune

MAX_HEAD_DIM = 256  # the per-chunk kernels hold a chunk's full key rows
G_FLOOR: tl.constexpr = tl.constexpr(-200.0)  # runtime.G_FLOOR: exp(g) is 0 in fp32 below about -104


def _configs(options: tuple[tuple[int, int, int], ...]) -> list:
    """Autotune sets of (values per block, warps, stages); one config on the interpreter."""
    if _INTERPRET:
        return [triton.Config({"BV": 32}, num_warps=4)]
    return [triton.Config({"BV": bv}, num_warps=w, num_stages=s) for bv, w, s in options]


# the winners of an 18- and a 12-config sweep (BV 32-128, 4-8 warps, 1-3 stages) over B 4, T 2k-16k, H 8-16, D
# 128 and small calls, bf16 and fp32, and their neighbours (H100, bench/log/2026-11-26-issue33.md)
_OUTPUT_CONFIGS = ((32, 4, 2), (32, 4, 3), (64, 4, 2), (128, 4, 1), (128, 4, 2), (128, 8, 1))
_GRADS_CONFIGS = ((64, 8, 1), (64, 8, 3), (64, 4, 2), (32, 4, 2))


_KEY = ["K", "V", "BT", "PREC", "WORK"]


def precision(config: Any, dtype: torch.dtype) -> str:
    """Operand precision of the products: the input's 16-bit type, else config.dot_precision or tf32x3."""
    if dtype == torch.bfloat16:
        return "bf16"
    if dtype == torch.float16:
        return "fp16"
    return config.dot_precision or "tf32x3"


@triton.jit
def _scan(left_ptr, right_ptr, g_ptr, init_ptr, states_ptr, final_ptr, flags_ptr, seq_first_ptr, chunk_start_ptr,
          chunk_end_ptr, weight, H, G, K, V, REVERSE: tl.constexpr, HAS_INIT: tl.constexpr,
          STORE_FINAL: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
          KEY_GATES: tl.constexpr = False):
    """One [BK, BV] tile of the chunk-boundary states of one sequence and head, sequential over its chunks: each
    chunk's incoming state is stored, then `state = exp(Gc) state + (left o w)^T right`. Forward: left k, right v,
    w = exp(Gc - G), chunks in order, the states the chunks start from. REVERSE (backward): left q, right do,
    w = weight exp(G), last chunk first, starting from dS_N: the gradients of the states the chunks end in; the
    last carry is the initial state's gradient. left and right have H / G heads (G query heads share a key/value
    head: GQA; the reverse scan's q and do have G = 1). The forward flags the chunks of a sequence whose states turn
    non-finite, per tile (flags [chunks, H, tiles], _flag_sequence), so that the output kernel takes its exact path
    only there. KEY_GATES (GLA):
    g_ptr holds the cumulative gates per key [tokens, H, K] (kernel_gla.py), each key row decays by its own."""
    i_tile, nh = tl.program_id(0), tl.program_id(1)
    n, h = nh // H, nh % H
    n_v = tl.cdiv(V, BV)
    rk, rv = (i_tile // n_v) * BK + tl.arange(0, BK), (i_tile % n_v) * BV + tl.arange(0, BV)
    tile_mask = (rk[:, None] < K) & (rv[None, :] < V)
    tile = rk[:, None] * V + rv[None, :]
    if HAS_INIT:
        state = tl.load(init_ptr + nh.to(tl.int64) * K * V + tile, mask=tile_mask, other=0.0).to(tl.float32)
    else:
        state = tl.zeros((BK, BV), tl.float32)
    first, last, bos, eos = _sequence(seq_first_ptr, chunk_start_ptr, chunk_end_ptr, n)
    for i in range(first, last):
        c = first + last - 1 - i if REVERSE else i
        tl.store(states_ptr + (c * H + h).to(tl.int64) * K * V + tile, state.to(states_ptr.dtype.element_ty),
                 mask=tile_mask)
        rows = bos + (c - first) * BT + tl.arange(0, BT)
        valid = rows < eos
        if not KEY_GATES:
            gc, gsum = _gates(g_ptr + h, rows, valid, H)
        lt = _load_cols(left_ptr + (h // G) * K, rows, valid, (H // G) * K, rk, K)
        rgt = _load_rows_raw(right_ptr + (h // G) * V, rows, valid, (H // G) * V, 0, rv, V)
        if KEY_GATES:  # [BK, BT] cumulative gates; the chunk's total is its last token's
            gk = _load_cols(g_ptr + h * K, rows, valid, H * K, rk, K)
            end = tl.minimum(bos + (c - first + 1) * BT, eos) - 1
            gtot = tl.load(g_ptr + end.to(tl.int64) * H * K + h * K + rk, mask=rk < K, other=0.0)
            w = weight * tl.exp(gk) if REVERSE else tl.exp(gtot[:, None] - gk)
            state = _dot(_operand(lt.to(tl.float32) * w, lt, PREC), rgt, PREC, state * tl.exp(gtot)[:, None])
        else:
            w = weight * tl.exp(gc) if REVERSE else tl.exp(gsum - gc)
            state = _dot(_operand(lt.to(tl.float32) * w[None, :], lt, PREC), rgt, PREC, state * tl.exp(gsum))
    if not REVERSE:
        _flag_sequence(state, flags_ptr, first, last, H, h, tl.num_programs(0), i_tile)
    if STORE_FINAL:
        tl.store(final_ptr + nh.to(tl.int64) * K * V + tile, state, mask=tile_mask)


@triton.jit
def _flag_sequence(state, flags_ptr, first, last, H, h, n_tiles, i_tile):
    """Flags (zeros beforehand) every chunk of the sequence for the output kernel's exact path when the scan's last
    state holds a non-finite value. A non-finite value or key makes its own and every later state non-finite (no sum
    and no product by a decay, even exp(-200) = 0, turns NaN or inf finite again), so a finite last state clears
    the whole sequence. A check per chunk inside the loop cost 30% of the scan at H 8 (H100, T 16k: 343 us against
    246; bench/log/2026-11-27-issue33-s5.md)."""
    if tl.max(tl.max(((state - state) != 0).to(tl.int32), 1), 0) > 0:
        for c in range(first, last):
            tl.store(flags_ptr + (c * H + h) * n_tiles + i_tile, 1)


@triton.jit
def _gates(g_ptr, rows, valid, H):
    """Cumulative log gates inside the chunk and their total, a gate below G_FLOOR taken as G_FLOOR: exp(g)
    underflows to 0 there already, and g = -inf (a full reset) then forms no -inf - -inf = NaN in the decay
    exponents. NaN and +inf gates stay what they are."""
    g = tl.load(g_ptr + rows * H, mask=valid, other=0.0).to(tl.float32)
    g = tl.where(g < G_FLOOR, G_FLOOR, g)
    gc = tl.cumsum(g, 0)
    return gc, tl.sum(g, 0)


@triton.jit
def _causal(x, BT: tl.constexpr):
    """x where s <= t, else exactly 0 (a select, not a product: 0 * NaN would carry a later token's NaN back)."""
    t = tl.arange(0, BT)
    return tl.where(t[None, :] <= t[:, None], x, 0.0)


@triton.jit
def _chunk_rows(chunk_start_ptr, chunk_end_ptr, c, BT: tl.constexpr):
    bos = tl.load(chunk_start_ptr + c)
    rows = bos + tl.arange(0, BT)
    return rows, rows < tl.load(chunk_end_ptr + c)


@autotune(name="linear_scan", configs=_configs(_OUTPUT_CONFIGS), key=[*_KEY, "KEY_GATES"])
@triton.jit
def _output(q_ptr, k_ptr, v_ptr, g_ptr, states_ptr, flags_ptr, o_ptr, scores_ptr, chunk_start_ptr, chunk_end_ptr,
            scale, H, G, K, V, WORK, N_FLAGS, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
            PREC: tl.constexpr, FLAGS: tl.constexpr, KEY_GATES: tl.constexpr = False):
    """o for one chunk, head and [BV] block of values: scale (exp(G) o (q S_c) + ((q k^T) o D) v), the keys in
    [BK] blocks, as fla's kernel does. Non-finite values take a separate path, chosen by the scan's flags: checked
    here, on the loaded tile, they cost 10% (H100, T 16k, H 16: 771 us against 697 unchecked, whole key rows;
    640 in blocks with the flags, on another H100 the same day; bench/log/2026-11-26-issue33.md). KEY_GATES (GLA):
    g_ptr holds the cumulative gates per key, and the chunk's masked scores come from kernel_gla._intra_scores
    (scores_ptr [tokens, H, BT] fp32)."""
    i_v, c, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows, valid = _chunk_rows(chunk_start_ptr, chunk_end_ptr, c, BT)
    if not KEY_GATES:
        gc, _ = _gates(g_ptr + h, rows, valid, H)
    cv = i_v * BV + tl.arange(0, BV)
    part = (c * H + h).to(tl.int64) * K * V
    o = tl.zeros((BT, BV), tl.float32)
    scores = tl.zeros((BT, BT), tl.float32)
    for k0 in range(0, K, BK):
        ck = k0 + tl.arange(0, BK)
        q = _load_rows_raw(q_ptr + h * K, rows, valid, H * K, 0, ck, K)
        s0_at, s0_mask = states_ptr + part + ck[:, None] * V + cv[None, :], (ck[:, None] < K) & (cv[None, :] < V)
        if KEY_GATES:
            s0 = tl.load(s0_at, mask=s0_mask, other=0.0)
            gq = _load_rows_raw(g_ptr + h * K, rows, valid, H * K, 0, ck, K)
            o = _dot(_operand(q.to(tl.float32) * tl.exp(gq), q, PREC), s0.to(q.dtype), PREC, o)
        else:
            kt = _load_cols(k_ptr + (h // G) * K, rows, valid, (H // G) * K, ck, K)
            s0 = tl.load(s0_at, mask=s0_mask, other=0.0)
            o = _dot(q, s0.to(q.dtype), PREC, o)
            scores = _dot(q, kt, PREC, scores)
    v = _load_rows_raw(v_ptr + (h // G) * V, rows, valid, (H // G) * V, 0, cv, V)
    if KEY_GATES:
        scores = tl.load(scores_ptr + rows[:, None] * (H * BT) + h * BT + tl.arange(0, BT)[None, :],
                         mask=valid[:, None], other=0.0).to(v.dtype)
    else:
        o = o * tl.exp(gc)[:, None]
        scores = _causal(scores * _decay_mask(gc, BT), BT).to(v.dtype)
    flagged = tl.load(flags_ptr + (c * H + h) * N_FLAGS + tl.arange(0, FLAGS), mask=tl.arange(0, FLAGS) < N_FLAGS,
                      other=0)
    if tl.max(flagged, 0) > 0:
        # a non-finite value reaches its own and later rows only (0 * NaN would reach the earlier ones): it is
        # zeroed in the product and its column is NaN from its row on
        bad = (v - v) != 0
        o = _dot(scores, tl.where(bad, 0.0, v).to(v.dtype), PREC, o) * scale
        reached = tl.dot(_causal(tl.full((BT, BT), 1.0, tl.float16), BT).to(tl.float16), bad.to(tl.float16))
        o = tl.where(reached > 0, float("nan"), o)
    else:
        o = _dot(scores, v, PREC, o) * scale
    tl.store(o_ptr + rows[:, None] * (H * V) + h * V + cv[None, :], o.to(o_ptr.dtype.element_ty),
             mask=valid[:, None] & (cv[None, :] < V))


@autotune(name="linear_scan", configs=_configs(_GRADS_CONFIGS), key=_KEY)
@triton.jit
def _grads(q_ptr, k_ptr, v_ptr, g_ptr, do_ptr, states_ptr, dstates_ptr, dq_ptr, dk_ptr, dv_ptr, dgt_ptr,
           chunk_start_ptr, chunk_end_ptr, scale, H, G, K, V, WORK, BT: tl.constexpr, BK: tl.constexpr,
           BV: tl.constexpr, PREC: tl.constexpr):
    """dq, dk, dv and dG_t = q_t . dq_t - k_t . dk_t of one chunk and head, the values in [BV] blocks (module
    docstring); dk and dv per query head (the caller sums a GQA group's)."""
    c, h = tl.program_id(0), tl.program_id(1)
    rows, valid = _chunk_rows(chunk_start_ptr, chunk_end_ptr, c, BT)
    gc, gtot = _gates(g_ptr + h, rows, valid, H)
    ck = tl.arange(0, BK)
    q = _load_rows_raw(q_ptr + h * K, rows, valid, H * K, 0, ck, K)
    k = _load_rows_raw(k_ptr + (h // G) * K, rows, valid, (H // G) * K, 0, ck, K)
    decay = _decay_mask(gc, BT)
    scores_t = tl.trans(_causal(_dot(q, tl.trans(k), PREC) * decay, BT) * scale)  # A^T [s, t]
    dq = tl.zeros((BT, BK), tl.float32)
    dk = tl.zeros((BT, BK), tl.float32)
    dp = tl.zeros((BT, BT), tl.float32)
    part = (c * H + h).to(tl.int64) * K * V
    to_end = tl.exp(gtot - gc)
    for v0 in range(0, V, BV):
        cv = v0 + tl.arange(0, BV)
        tile_mask = (ck[:, None] < K) & (cv[None, :] < V)
        tile = ck[:, None] * V + cv[None, :]
        do = _load_rows_raw(do_ptr + h * V, rows, valid, H * V, 0, cv, V)
        v = _load_rows_raw(v_ptr + (h // G) * V, rows, valid, (H // G) * V, 0, cv, V)
        s0 = _operand(tl.load(states_ptr + part + tile, mask=tile_mask, other=0.0), q, PREC)
        ds = _operand(tl.load(dstates_ptr + part + tile, mask=tile_mask, other=0.0), q, PREC)
        dq = _dot(do, tl.trans(s0), PREC, dq)
        dk = _dot(v, tl.trans(ds), PREC, dk)
        dp = _dot(do, tl.trans(v), PREC, dp)
        dv = _dot(k, ds, PREC) * to_end[:, None]
        dv = _dot(_operand(scores_t, q, PREC), do, PREC, dv)
        tl.store(dv_ptr + rows[:, None] * (H * V) + h * V + cv[None, :], dv.to(dv_ptr.dtype.element_ty),
                 mask=valid[:, None] & (cv[None, :] < V))
    dp = _operand(_causal(dp * decay, BT) * scale, q, PREC)
    dq = _dot(dp, k, PREC, dq * (scale * tl.exp(gc))[:, None])
    dk = _dot(tl.trans(dp), q, PREC, dk * to_end[:, None])
    dgt = tl.sum(q.to(tl.float32) * dq, 1) - tl.sum(k.to(tl.float32) * dk, 1)
    at = rows[:, None] * (H * K) + h * K + ck[None, :]
    mask = valid[:, None] & (ck[None, :] < K)
    tl.store(dq_ptr + at, dq.to(dq_ptr.dtype.element_ty), mask=mask)
    tl.store(dk_ptr + at, dk.to(dk_ptr.dtype.element_ty), mask=mask)
    tl.store(dgt_ptr + rows * H + h, dgt, mask=valid)


@triton.jit
def _operand(x, like, PREC: tl.constexpr):
    """A computed product operand: rounded to the inputs' 16-bit type for 16-bit products, else kept fp32."""
    if PREC == "bf16" or PREC == "fp16":
        return x.to(like.dtype)
    else:
        return x


@triton.jit
def _step(q_ptr, k_ptr, v_ptr, g_ptr, init_ptr, o_ptr, final_ptr, scale, T, H, G, K, V, HAS_INIT: tl.constexpr,
          BK: tl.constexpr, BV: tl.constexpr, KEY_GATES: tl.constexpr = False):
    """Decoding: one [K, BV] state tile of one (sequence, head) in registers across the call's tokens. KEY_GATES
    (GLA): g [B, T, H, K], a decay per key row."""
    i_v, bh = tl.program_id(0), tl.program_id(1)
    b, head = bh // H, bh % H
    ck, cv = tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    k_ok, v_ok = ck < K, cv < V
    tile = bh.to(tl.int64) * K * V + ck[:, None] * V + cv[None, :]
    tile_mask = k_ok[:, None] & v_ok[None, :]
    if HAS_INIT:
        state = tl.load(init_ptr + tile, mask=tile_mask, other=0.0).to(tl.float32)
    else:
        state = tl.zeros((BK, BV), tl.float32)
    one = tl.zeros([1], dtype=tl.int32)
    for t in range(T):
        tok = (b.to(tl.int64) * T + t) * H + head
        q = tl.load(q_ptr + tok * K + ck, mask=k_ok, other=0.0).to(tl.float32)
        kv_tok = (b.to(tl.int64) * T + t) * (H // G) + head // G
        k = tl.load(k_ptr + kv_tok * K + ck, mask=k_ok, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + kv_tok * V + cv, mask=v_ok, other=0.0).to(tl.float32)
        if KEY_GATES:
            g = tl.load(g_ptr + tok * K + ck, mask=k_ok, other=0.0).to(tl.float32)
        else:
            g = tl.load(g_ptr + tok + one).to(tl.float32)
        decay = tl.exp(tl.where(g < G_FLOOR, G_FLOOR, g))
        state = decay[:, None] * state + k[:, None] * v[None, :]
        o = scale * tl.sum(state * q[:, None], 0)
        tl.store(o_ptr + tok * V + cv, o.to(o_ptr.dtype.element_ty), mask=v_ok)
    tl.store(final_ptr + tile, state, mask=tile_mask)


# --- launchers ---------------------------------------------------------------------------------------------


def _state_dtype(q: torch.Tensor, prec: str) -> torch.dtype:
    """Chunk states in the inputs' 16-bit dtype where the products round them to it anyway, else fp32."""
    return q.dtype if prec in ("bf16", "fp16") else torch.float32


def grad_precision(config: Any, dtype: torch.dtype) -> str:
    """The backward's operand precision: config.grad_precision "tf32" (fp32 states, TF32 products: bf16 inputs'
    gate gradient 3e-3 from the float64 recurrence, against 4.5e-3 with bf16 products; interpreter, T 300) or
    "input" (the forward's)."""
    return precision(config, dtype) if config.grad_precision == "input" or dtype == torch.float32 else "tf32"


def _head_dims(q: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int]:
    K, V = q.shape[3], v.shape[3]
    if max(K, V) > MAX_HEAD_DIM:
        raise ValueError(f"head dims up to {MAX_HEAD_DIM} (K {K}, V {V})")
    return K, V, max(16, _pow2(K))


def _run_scan(config, left, right, g, init, table, chunk, weight, reverse, final, prec, key_gates=False):
    first, start, end, n_seq, n_chunks, _ = table
    heads, K, V = g.shape[2], left.shape[3], right.shape[3]
    bk, bv, warps = config.scan_tiles
    bk, bv = min(bk, max(16, _pow2(K))), min(bv, max(16, _pow2(V)))
    states = _empty((n_chunks, heads, K, V), _state_dtype(left, prec), left.device, config.poison_outputs)
    out = _empty((n_seq, heads, K, V), torch.float32, left.device, config.poison_outputs) if final else states
    grid = (triton.cdiv(K, bk) * triton.cdiv(V, bv), n_seq * heads)
    flags = None if reverse else torch.zeros((n_chunks, heads, grid[0]), dtype=torch.int32, device=left.device)
    _fast(_scan)[grid](left, right, g, init if init is not None else states, states, out,
                       flags if flags is not None else states, first, start, end, float(weight), heads,
                       heads // left.shape[2], K, V, REVERSE=reverse, HAS_INIT=init is not None, STORE_FINAL=final,
                       BT=chunk, BK=bk, BV=bv, PREC=prec, KEY_GATES=key_gates, num_warps=warps)
    return states, (out if final else None), flags


def forward(config, q, k, v, g, s_init, cu_seqlens, scale, chunk, final):
    B, T, heads, _ = q.shape
    K, V, bk = _head_dims(q, v)
    table = chunk_table(B, T, cu_seqlens, chunk, q.device)
    prec = precision(config, q.dtype)
    states, s_fin, flags = _run_scan(config, k, v, g, s_init, table, chunk, 1.0, False, final, prec)
    o = _empty((*q.shape[:3], V), v.dtype, v.device, config.poison_outputs)
    n_chunks = table[4]
    _fast(_output)[lambda meta: (triton.cdiv(V, meta["BV"]), n_chunks, heads)](
        q, k, v, g, states, flags, o, o, table[1], table[2], float(scale), heads, heads // k.shape[2], K, V,
        _work(n_chunks, heads),
        flags.shape[2], BT=chunk, BK=min(bk, 64), PREC=prec, FLAGS=max(2, _pow2(flags.shape[2])), KEY_GATES=False)
    return o, s_fin


def backward(config, do, ds_fin, q, k, v, g, s_init, cu_seqlens, scale, chunk):
    """(dq, dk, dv, dg, ds_init); ds_init None without s_init."""
    B, T, heads, _ = q.shape
    K, V, bk = _head_dims(q, v)
    table = chunk_table(B, T, cu_seqlens, chunk, q.device)
    prec = grad_precision(config, q.dtype)
    do = do.contiguous()
    states, s_fin, _ = _run_scan(config, k, v, g, s_init, table, chunk, 1.0, False, ds_fin is not None, prec)
    dstates, ds_init, _ = _run_scan(config, q, do, g, ds_fin, table, chunk, scale, True, s_init is not None, prec)
    poison, n_chunks = config.poison_outputs, table[4]
    group = heads // k.shape[2]
    grouped = torch.float32 if group > 1 else None  # per query head, summed over each group below
    dq = _empty(q.shape, q.dtype, q.device, poison)
    dk = _empty(q.shape, grouped or k.dtype, k.device, poison)
    dv = _empty((*q.shape[:3], V), grouped or v.dtype, v.device, poison)
    dgt = _empty(g.shape, torch.float32, g.device, poison)
    _fast(_grads)[(n_chunks, heads)](q, k, v, g, do, states, dstates, dq, dk, dv, dgt, table[1], table[2],
                                     float(scale), heads, group, K, V, _work(n_chunks, heads), BT=chunk, BK=bk,
                                     PREC=prec)
    if group > 1:
        dk = dk.view(B, T, heads // group, group, K).sum(3).to(k.dtype)
        dv = dv.view(B, T, heads // group, group, V).sum(3).to(v.dtype)
    if ds_fin is not None:  # the final state reads every gate of its sequence: <S_T, dS_T> at its last token
        ends = torch.tensor(table[5][1:], device=g.device) - 1
        flat = dgt.view(-1, heads)
        flat[ends] += (s_fin * ds_fin).sum((-2, -1))
    dg = _reverse_cumsum(dgt, table, B, T).to(g.dtype)
    return dq, dk, dv, dg, ds_init


def recurrent(config, q, k, v, g, s_init, scale):
    B, T, heads, _ = q.shape
    K, V, bk = _head_dims(q, v)
    q, k, v, g = (t.contiguous() for t in (q, k, v, g))
    o = _empty((B, T, heads, V), v.dtype, v.device, config.poison_outputs)
    s_fin = torch.empty((B, heads, K, V), dtype=torch.float32, device=q.device)
    bv = min(32, max(16, _pow2(V)))
    _fast(_step)[(triton.cdiv(V, bv), B * heads)](
        q, k, v, g, s_init.contiguous() if s_init is not None else s_fin, o, s_fin, float(scale), T, heads,
        heads // k.shape[2], K, V,
        HAS_INIT=s_init is not None, BK=bk, BV=bv, num_warps=4)
    return o, s_fin
