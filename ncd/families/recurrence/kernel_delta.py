"""Chunked delta rule and gated delta rule (DeltaNet, Gated DeltaNet): forward, backward and decoding kernels, the
same for every spec of that form.

The recurrence, per (sequence, head), t along time, S [key, value] (fla's layout; the spec's S transposed):
    S_t = exp(g_t) (I - b_t k_t k_t^T) S_(t-1) + b_t k_t v_t^T,   o_t = scale S_t^T q_t      (no gate: g = 0)
Each token writes the correction u_t = b_t (v_t - exp(g_t) S_(t-1)^T k_t), S_t = exp(g_t) S_(t-1) + k_t u_t^T.
Chunked form through the UT / WY representation (chunk C; G the cumulative log gate inside the chunk, Gc its total;
D_ts = exp(G_t - G_s) for s <= t; S_c the state the chunk starts from):
    A = strict_lower(diag(b) (k k^T) o D),  T = (I + A)^-1                 (blocks of 16 rows: _solve)
    W = T diag(b exp(G)) k,  U = T diag(b) v                                (_wu, parallel over chunks)
    u = U - W S_c;  S_(c+1) = exp(Gc) S_c + (k o exp(Gc - G))^T u          (sequential over chunks: _scan)
    o = scale ((q o exp(G)) S_c + ((q k^T) o D) u)                          (parallel over chunks: _output)
Backward (dS_c: the gradient of the state after chunk c; P = scale (q k^T) o D):
    du = P^T do + (k o exp(Gc - G)) dS_c;  dS_(c-1) = exp(Gc) dS_c + scale (q o exp(G))^T do - W^T du   (_rscan)
    per chunk (_grads): dW = -du S_c^T, dT = du (b v)^T + dW (b exp(G) k)^T, dA = -T^T dT T^T (strictly lower),
    dv = b T^T du, dk from W, A, P and the end state, db from U, W and A, and dG_t (the exponents' rows minus their
    columns, plus Gc's terms at the chunk's last token), whose reverse sum inside the chunk is dg.
Every exponent is a difference G_t - G_s with s <= t inside one chunk, or a chunk's partial or full total: never
positive (g <= 0), so nothing overflows. Products multiply the inputs' 16-bit values (T and the weighted operands
rounded to them, as fla does) or, for fp32 inputs, tf32x3 ones; accumulation is fp32. T's diagonal blocks are
solved in fp32, its blocks below with TF32 products for 16-bit inputs (as fla's) and tf32x3 ones for fp32 inputs.

Non-finite inputs: a non-finite key, beta or gate (NaN, +inf) at token t makes the outputs NaN from t on, a
non-finite value entry (t, j) value column j from t on, a non-finite query its own row: exactly where the float64
recurrence has them (the kernels zero those entries in their products and put NaN where they reach). The gradients
are non-finite at least where the recurrence's are.

forward(config, q, k, v, g, b, s_init, cu_seqlens, scale, chunk, final) -> (o, s_fin)
backward(config, do, ds_fin, q, k, v, g, b, s_init, cu_seqlens, scale, chunk) -> (dq, dk, dv, dg, db, ds_init)
recurrent(config, q, k, v, g, b, s_init, scale) -> (o, s_fin): decoding, token by token from a state.
q, k [B, T, H, K], v [B, T, H, V], g (None: no gate) and b [B, T, H]; states [N, H, K, V] fp32; cu_seqlens packs
N sequences into B = 1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ncd.families.recurrence.kernel import (
    _decay_mask,
    _dot,
    _empty,
    _load_cols,
    _load_rows_raw,
    _pow2,
    _sequence,
    chunk_table,
)
from ncd.families.recurrence.kernel_linear import (
    G_FLOOR,
    _causal,
    _chunk_rows,
    _flag_sequence,
    _gates,
    _head_dims,
    _operand,
    _state_dtype,
    grad_precision,
    precision,
)
from ncd.launch import fast as _fast
from ncd.launch import sm_count


@triton.jit
def _chunk_gates(g_ptr, rows, valid, H, GATED: tl.constexpr, BT: tl.constexpr):
    """Cumulative log gates inside the chunk and their total (_gates); zeros without a gate."""
    if GATED:
        return _gates(g_ptr, rows, valid, H)
    else:
        zero = tl.zeros((BT,), tl.float32)
        return zero, tl.sum(zero, 0)


@triton.jit
def _unit_lower_inverse(a, BT: tl.constexpr):
    """(I + A)^-1 of a strictly lower-triangular A, by forward substitution in fp32: row i of the inverse is e_i -
    sum_j A_ij (row j of the inverse), over j < i (A_ij = 0 for j >= i, whose rows are still e_j)."""
    t = tl.arange(0, BT)
    inv = tl.where(t[:, None] == t[None, :], 1.0, 0.0)
    for i in range(1, BT):
        a_row = tl.sum(tl.where(t[:, None] == i, a, 0.0), 0)
        row = (t == i).to(tl.float32) - tl.sum(a_row[:, None] * inv, 0)
        inv = tl.where(t[:, None] == i, row[None, :], inv)
    return inv


@triton.jit
def _block_scalars(g_ptr, b_ptr, bos, eos, h, H, block: tl.constexpr, GATED: tl.constexpr):
    """Rows 16 block .. 16 block + 15 of a chunk: their positions, b and the log gates (floored), and which rows
    have a non-finite beta or gate (NaN or +inf)."""
    rows = bos + block * 16 + tl.arange(0, 16)
    valid = rows < eos
    b = tl.load(b_ptr + rows * H + h, mask=valid, other=0.0).to(tl.float32)
    bad = (b - b) != 0
    if GATED:
        g = tl.load(g_ptr + rows * H + h, mask=valid, other=0.0).to(tl.float32)
        bad = bad | (g != g) | (g == float("inf"))
        g = tl.where(bad, 0.0, tl.where(g < G_FLOOR, G_FLOOR, g))
    else:
        g = tl.zeros((16,), tl.float32)
    return rows, valid, b, g, bad


@triton.jit
def _key_block(k_ptr, rows, valid, h, H, K, k0, BK: tl.constexpr):
    """Columns k0 .. k0 + BK - 1 of a block's keys with non-finite entries zeroed, and which rows had one."""
    k = _load_rows_raw(k_ptr + h * K, rows, valid, H * K, k0, tl.arange(0, BK), K)
    finite = (k - k) == 0
    return tl.where(finite, k, 0.0).to(k.dtype), tl.min(finite.to(tl.int32), 1) == 0


@triton.jit
def _a_block(kk, bi, gi, gj, DIAG: tl.constexpr):
    """A_IJ = diag(b_I) (k_I k_J^T) o exp(G_I - G_J) from kk = k_I k_J^T: strictly lower on the diagonal (DIAG),
    whole below it."""
    a = kk * bi[:, None]
    if DIAG:
        r = tl.arange(0, 16)
        below = r[None, :] < r[:, None]
        return tl.where(below, a * tl.exp(tl.where(below, gi[:, None] - gj[None, :], 0.0)), 0.0)
    else:
        return a * tl.exp(gi[:, None] - gj[None, :])


@triton.jit
def _solve(k_ptr, g_ptr, b_ptr, t_ptr, bad_ptr, chunk_start_ptr, chunk_end_ptr, H, K, GATED: tl.constexpr,
           BT: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr, MERGE: tl.constexpr):
    """T = (I + A)^-1 of one chunk and head (module docstring; lower triangle stored), by blocks of 16 rows as
    fla's solve: the ten k_I k_J^T blocks over [BK] key columns at a time, each diagonal block of T by forward
    substitution, the blocks below by T_IJ = -T_II sum_(J <= M < I) A_IM T_MJ (MERGE: tf32x3 products for fp32
    inputs; TF32 for 16-bit ones, whose products round T to 16 bits anyway, as fla's). A bad row (a non-finite
    key, beta or gate) reaches only the rows of T after it (T is lower triangular); its index in the chunk (BT:
    none) is stored for _wu, which puts NaN there."""
    c, h = tl.program_id(0), tl.program_id(1)
    bos, eos = tl.load(chunk_start_ptr + c), tl.load(chunk_end_ptr + c)
    NB: tl.constexpr = BT // 16
    r = tl.arange(0, 16)
    t_at = t_ptr + h * BT
    z = tl.zeros((16, 16), tl.float32)
    rows0, ok0, b0, g0, bad0 = _block_scalars(g_ptr, b_ptr, bos, eos, h, H, 0, GATED)
    kk00 = z
    if NB >= 2:
        rows1, ok1, b1, g1, bad1 = _block_scalars(g_ptr, b_ptr, bos, eos, h, H, 1, GATED)
        kk10, kk11 = z, z
    if NB >= 4:
        rows2, ok2, b2, g2, bad2 = _block_scalars(g_ptr, b_ptr, bos, eos, h, H, 2, GATED)
        rows3, ok3, b3, g3, bad3 = _block_scalars(g_ptr, b_ptr, bos, eos, h, H, 3, GATED)
        kk20, kk21, kk22, kk30, kk31, kk32, kk33 = z, z, z, z, z, z, z
    for k0 in range(0, K, BK):
        k0b, bad = _key_block(k_ptr, rows0, ok0, h, H, K, k0, BK)
        bad0 = bad0 | bad
        kk00 = _dot(k0b, tl.trans(k0b), PREC, kk00)
        if NB >= 2:
            k1b, bad = _key_block(k_ptr, rows1, ok1, h, H, K, k0, BK)
            bad1 = bad1 | bad
            kk10 = _dot(k1b, tl.trans(k0b), PREC, kk10)
            kk11 = _dot(k1b, tl.trans(k1b), PREC, kk11)
        if NB >= 4:
            k2b, bad = _key_block(k_ptr, rows2, ok2, h, H, K, k0, BK)
            bad2 = bad2 | bad
            kk20 = _dot(k2b, tl.trans(k0b), PREC, kk20)
            kk21 = _dot(k2b, tl.trans(k1b), PREC, kk21)
            kk22 = _dot(k2b, tl.trans(k2b), PREC, kk22)
            k3b, bad = _key_block(k_ptr, rows3, ok3, h, H, K, k0, BK)
            bad3 = bad3 | bad
            kk30 = _dot(k3b, tl.trans(k0b), PREC, kk30)
            kk31 = _dot(k3b, tl.trans(k1b), PREC, kk31)
            kk32 = _dot(k3b, tl.trans(k2b), PREC, kk32)
            kk33 = _dot(k3b, tl.trans(k3b), PREC, kk33)
    b0 = tl.where(bad0, 0.0, b0)
    g0 = tl.cumsum(tl.where(bad0, 0.0, g0), 0)
    t00 = _unit_lower_inverse(_a_block(kk00, b0, g0, g0, True), 16)
    _store_t(t_at, rows0, ok0, H * BT, 0, t00)
    first_bad = tl.min(tl.where(bad0, r, BT), 0)
    if NB >= 2:
        b1 = tl.where(bad1, 0.0, b1)
        g1 = tl.cumsum(tl.where(bad1, 0.0, g1), 0) + tl.sum(tl.where(r == 15, g0, 0.0), 0)
        t11 = _unit_lower_inverse(_a_block(kk11, b1, g1, g1, True), 16)
        t10 = -_dot(t11, _dot(_a_block(kk10, b1, g1, g0, False), t00, MERGE), MERGE)
        _store_t(t_at, rows1, ok1, H * BT, 0, t10)
        _store_t(t_at, rows1, ok1, H * BT, 16, t11)
        first_bad = tl.minimum(first_bad, tl.min(tl.where(bad1, 16 + r, BT), 0))
    if NB >= 4:
        b2 = tl.where(bad2, 0.0, b2)
        g2 = tl.cumsum(tl.where(bad2, 0.0, g2), 0) + tl.sum(tl.where(r == 15, g1, 0.0), 0)
        t22 = _unit_lower_inverse(_a_block(kk22, b2, g2, g2, True), 16)
        a21 = _a_block(kk21, b2, g2, g1, False)
        t21 = -_dot(t22, _dot(a21, t11, MERGE), MERGE)
        t20 = -_dot(t22, _dot(a21, t10, MERGE, _dot(_a_block(kk20, b2, g2, g0, False), t00, MERGE)), MERGE)
        _store_t(t_at, rows2, ok2, H * BT, 0, t20)
        _store_t(t_at, rows2, ok2, H * BT, 16, t21)
        _store_t(t_at, rows2, ok2, H * BT, 32, t22)
        b3 = tl.where(bad3, 0.0, b3)
        g3 = tl.cumsum(tl.where(bad3, 0.0, g3), 0) + tl.sum(tl.where(r == 15, g2, 0.0), 0)
        t33 = _unit_lower_inverse(_a_block(kk33, b3, g3, g3, True), 16)
        a31 = _a_block(kk31, b3, g3, g1, False)
        a32 = _a_block(kk32, b3, g3, g2, False)
        t32 = -_dot(t33, _dot(a32, t22, MERGE), MERGE)
        t31 = -_dot(t33, _dot(a32, t21, MERGE, _dot(a31, t11, MERGE)), MERGE)
        t30 = -_dot(t33, _dot(a32, t20, MERGE, _dot(a31, t10, MERGE, _dot(_a_block(kk30, b3, g3, g0, False), t00,
                                                                          MERGE))), MERGE)
        _store_t(t_at, rows3, ok3, H * BT, 0, t30)
        _store_t(t_at, rows3, ok3, H * BT, 16, t31)
        _store_t(t_at, rows3, ok3, H * BT, 32, t32)
        _store_t(t_at, rows3, ok3, H * BT, 48, t33)
        first_bad = tl.minimum(first_bad, tl.min(tl.where(bad2, 32 + r, BT), 0))
        first_bad = tl.minimum(first_bad, tl.min(tl.where(bad3, 48 + r, BT), 0))
    tl.store(bad_ptr + c * H + h, first_bad)


@triton.jit
def _wu(k_ptr, v_ptr, g_ptr, b_ptr, t_ptr, bad_ptr, w_ptr, u_ptr, chunk_start_ptr, chunk_end_ptr, H, K, V,
        GATED: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr):
    """W = T diag(b exp(G)) k and U = T diag(b) v of one chunk and head, [BC] columns at a time (T from _solve,
    rounded to the products' operand type, as fla does). Non-finite entries are zeroed before the products and put
    back as NaN where they reach: the W and U rows from the chunk's first bad key, beta or gate row on (_solve's
    index), a bad value entry's U column from its row on."""
    c, h = tl.program_id(0), tl.program_id(1)
    rows, valid = _chunk_rows(chunk_start_ptr, chunk_end_ptr, c, BT)
    t = tl.arange(0, BT)
    first_bad = tl.load(bad_ptr + c * H + h)
    bad = t >= first_bad
    b = tl.where(bad, 0.0, tl.load(b_ptr + rows * H + h, mask=valid, other=0.0).to(tl.float32))
    if GATED:
        g = tl.load(g_ptr + rows * H + h, mask=valid, other=0.0).to(tl.float32)
        scaling = b * tl.exp(tl.cumsum(tl.where(bad, 0.0, tl.where(g < G_FLOOR, G_FLOOR, g)), 0))
    else:
        scaling = b
    inv = tl.load(t_ptr + rows[:, None] * (H * BT) + h * BT + t[None, :],
                  mask=valid[:, None] & (t[None, :] <= t[:, None]), other=0.0)
    for c0 in range(0, K, BC):
        col = c0 + tl.arange(0, BC)
        k = _load_rows_raw(k_ptr + h * K, rows, valid, H * K, 0, col, K)
        w = _dot(_operand(inv, k, PREC), _operand(tl.where(bad[:, None], 0.0, k.to(tl.float32)) * scaling[:, None],
                                                  k, PREC), PREC)
        w = tl.where(bad[:, None], float("nan"), w)
        tl.store(w_ptr + rows[:, None] * (H * K) + h * K + col[None, :], w.to(w_ptr.dtype.element_ty),
                 mask=valid[:, None] & (col[None, :] < K))
    for c0 in range(0, V, BC):
        col = c0 + tl.arange(0, BC)
        v = _load_rows_raw(v_ptr + h * V, rows, valid, H * V, 0, col, V)
        bad_v = (v - v) != 0
        u = _dot(_operand(inv, v, PREC), _operand(tl.where(bad_v, 0.0, v.to(tl.float32)) * b[:, None], v, PREC), PREC)
        first_bad_v = tl.min(tl.where(bad_v, t[:, None], BT), 0)
        u = tl.where(bad[:, None] | (t[:, None] >= first_bad_v[None, :]), float("nan"), u)
        tl.store(u_ptr + rows[:, None] * (H * V) + h * V + col[None, :], u.to(u_ptr.dtype.element_ty),
                 mask=valid[:, None] & (col[None, :] < V))


@triton.jit
def _store_t(ptr, rows, valid, stride, col0, x):
    r = tl.arange(0, 16)
    tl.store(ptr + rows[:, None] * stride + col0 + r[None, :], x, mask=valid[:, None])


@triton.jit
def _scan(k_ptr, w_ptr, u_ptr, g_ptr, init_ptr, states_ptr, un_ptr, final_ptr, flags_ptr, seq_first_ptr,
          chunk_start_ptr, chunk_end_ptr, H, K, V, GATED: tl.constexpr, HAS_INIT: tl.constexpr,
          STORE_FINAL: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """A [K, BV] column block of the states of one sequence and head, sequential over its chunks: each chunk's
    incoming state S_c is stored, then u = U - W S_c (stored: the output's values) and S = exp(Gc) S_c + (k o
    exp(Gc - G))^T u. Value columns are independent in the delta rule; the key rows are not (W S_c). A sequence
    whose last state is non-finite has its chunks flagged (flags [chunks, H, tiles], _flag_sequence: a non-finite u
    entry reaches every later state): the output kernel takes its exact path only there."""
    i_v, nh = tl.program_id(0), tl.program_id(1)
    n, h = nh // H, nh % H
    ck, cv = tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    tile_mask = (ck[:, None] < K) & (cv[None, :] < V)
    tile = ck[:, None] * V + cv[None, :]
    if HAS_INIT:
        state = tl.load(init_ptr + nh.to(tl.int64) * K * V + tile, mask=tile_mask, other=0.0).to(tl.float32)
    else:
        state = tl.zeros((BK, BV), tl.float32)
    first, last, bos, eos = _sequence(seq_first_ptr, chunk_start_ptr, chunk_end_ptr, n)
    for c in range(first, last):
        tl.store(states_ptr + (c * H + h).to(tl.int64) * K * V + tile, state.to(states_ptr.dtype.element_ty),
                 mask=tile_mask)
        rows = bos + (c - first) * BT + tl.arange(0, BT)
        valid = rows < eos
        gc, gtot = _chunk_gates(g_ptr + h, rows, valid, H, GATED, BT)
        w = _load_rows_raw(w_ptr + h * K, rows, valid, H * K, 0, ck, K)
        u = _load_rows_raw(u_ptr + h * V, rows, valid, H * V, 0, cv, V).to(tl.float32)
        u = u - _dot(w, _operand(state, w, PREC), PREC)
        tl.store(un_ptr + rows[:, None] * (H * V) + h * V + cv[None, :], u.to(un_ptr.dtype.element_ty),
                 mask=valid[:, None] & (cv[None, :] < V))
        kt = _load_cols(k_ptr + h * K, rows, valid, H * K, ck, K)
        state = _dot(_operand(kt.to(tl.float32) * tl.exp(gtot - gc)[None, :], kt, PREC), _operand(u, kt, PREC),
                     PREC, state * tl.exp(gtot))
    _flag_sequence(state, flags_ptr, first, last, H, h, tl.num_programs(0), i_v)
    if STORE_FINAL:
        tl.store(final_ptr + nh.to(tl.int64) * K * V + tile, state, mask=tile_mask)


@triton.jit
def _output(q_ptr, k_ptr, g_ptr, states_ptr, un_ptr, flags_ptr, o_ptr, chunk_start_ptr, chunk_end_ptr, scale, H, K,
            V, N_FLAGS, GATED: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
            PREC: tl.constexpr, FLAGS: tl.constexpr):
    """o for one chunk, head and [BV] block of values: scale (exp(G) o (q S_c) + ((q k^T) o D) u), the keys in
    [BK] blocks. A chunk of a sequence whose states turn non-finite (the scan's flags) takes a separate path: a
    non-finite u entry zeroed in the product and NaN from its row on, in its column (0 * NaN would carry it to the
    chunk's earlier rows)."""
    i_v, c, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows, valid = _chunk_rows(chunk_start_ptr, chunk_end_ptr, c, BT)
    gc, _ = _chunk_gates(g_ptr + h, rows, valid, H, GATED, BT)
    cv = i_v * BV + tl.arange(0, BV)
    part = (c * H + h).to(tl.int64) * K * V
    o = tl.zeros((BT, BV), tl.float32)
    scores = tl.zeros((BT, BT), tl.float32)
    for k0 in range(0, K, BK):
        ck = k0 + tl.arange(0, BK)
        q = _load_rows_raw(q_ptr + h * K, rows, valid, H * K, 0, ck, K)
        kt = _load_cols(k_ptr + h * K, rows, valid, H * K, ck, K)
        s0 = tl.load(states_ptr + part + ck[:, None] * V + cv[None, :], mask=(ck[:, None] < K) & (cv[None, :] < V),
                     other=0.0)
        o = _dot(q, s0.to(q.dtype), PREC, o)
        scores = _dot(q, kt, PREC, scores)
    o = o * tl.exp(gc)[:, None]
    u = _load_rows_raw(un_ptr + h * V, rows, valid, H * V, 0, cv, V)
    scores = _operand(_causal(scores * _decay_mask(gc, BT), BT), u, PREC)
    flagged = tl.load(flags_ptr + (c * H + h) * N_FLAGS + tl.arange(0, FLAGS), mask=tl.arange(0, FLAGS) < N_FLAGS,
                      other=0)
    if tl.max(flagged, 0) > 0:
        bad = (u - u) != 0
        o = _dot(scores, tl.where(bad, 0.0, u).to(u.dtype), PREC, o) * scale
        reached = tl.dot(_causal(tl.full((BT, BT), 1.0, tl.float16), BT).to(tl.float16), bad.to(tl.float16))
        o = tl.where(reached > 0, float("nan"), o)
    else:
        o = _dot(scores, u, PREC, o) * scale
    tl.store(o_ptr + rows[:, None] * (H * V) + h * V + cv[None, :], o.to(o_ptr.dtype.element_ty),
             mask=valid[:, None] & (cv[None, :] < V))


@triton.jit
def _rscan(q_ptr, k_ptr, w_ptr, g_ptr, do_ptr, dfinal_ptr, dstates_ptr, du_ptr, dinit_ptr, seq_first_ptr,
           chunk_start_ptr, chunk_end_ptr, scale, H, K, V, GATED: tl.constexpr, HAS_DFINAL: tl.constexpr,
           STORE_DINIT: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """The states' gradients, last chunk first, a [K, BV] column block: each chunk's dS_c (after it) is stored,
    then du = P^T do + (k o exp(Gc - G)) dS_c (stored) and dS_(c-1) = exp(Gc) dS_c + scale (q o exp(G))^T do -
    W^T du; the last carry is the initial state's gradient."""
    i_v, nh = tl.program_id(0), tl.program_id(1)
    n, h = nh // H, nh % H
    ck, cv = tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    tile_mask = (ck[:, None] < K) & (cv[None, :] < V)
    tile = ck[:, None] * V + cv[None, :]
    if HAS_DFINAL:
        ds = tl.load(dfinal_ptr + nh.to(tl.int64) * K * V + tile, mask=tile_mask, other=0.0).to(tl.float32)
    else:
        ds = tl.zeros((BK, BV), tl.float32)
    first, last, bos, eos = _sequence(seq_first_ptr, chunk_start_ptr, chunk_end_ptr, n)
    for i in range(first, last):
        c = first + last - 1 - i
        tl.store(dstates_ptr + (c * H + h).to(tl.int64) * K * V + tile, ds.to(dstates_ptr.dtype.element_ty),
                 mask=tile_mask)
        rows = bos + (c - first) * BT + tl.arange(0, BT)
        valid = rows < eos
        gc, gtot = _chunk_gates(g_ptr + h, rows, valid, H, GATED, BT)
        q = _load_rows_raw(q_ptr + h * K, rows, valid, H * K, 0, ck, K)
        k = _load_rows_raw(k_ptr + h * K, rows, valid, H * K, 0, ck, K)
        w = _load_rows_raw(w_ptr + h * K, rows, valid, H * K, 0, ck, K)
        do = _load_rows_raw(do_ptr + h * V, rows, valid, H * V, 0, cv, V)
        scores_t = tl.trans(_causal(_dot(q, tl.trans(k), PREC) * _decay_mask(gc, BT), BT) * scale)
        du = _dot(_operand(k.to(tl.float32) * tl.exp(gtot - gc)[:, None], k, PREC), _operand(ds, k, PREC), PREC)
        du = _dot(_operand(scores_t, do, PREC), do, PREC, du)
        tl.store(du_ptr + rows[:, None] * (H * V) + h * V + cv[None, :], du, mask=valid[:, None] & (cv[None, :] < V))
        ds = ds * tl.exp(gtot)
        ds = _dot(_operand(tl.trans(q.to(tl.float32) * (scale * tl.exp(gc))[:, None]), q, PREC), do, PREC, ds)
        ds = ds - _dot(tl.trans(w), _operand(du, w, PREC), PREC)
    if STORE_DINIT:
        tl.store(dinit_ptr + nh.to(tl.int64) * K * V + tile, ds, mask=tile_mask)


@triton.jit
def _grads(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, do_ptr, t_ptr, bad_ptr, states_ptr, dstates_ptr, un_ptr, du_ptr, dq_ptr,
           dk_ptr, dv_ptr, db_ptr, dg_ptr, chunk_start_ptr, chunk_end_ptr, scale, H, K, V, GATED: tl.constexpr,
           BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """dq, dk, dv, db and dg of one chunk and head, the values in [BV] blocks (module docstring). dG_t collects
    every exponent's derivative: +E where G_t is the row of a decay entry E, -E where it is the column, Gc's terms
    at the chunk's last token; dg_t is its reverse sum inside the chunk (G is cumulative in the chunk only)."""
    c, h = tl.program_id(0), tl.program_id(1)
    rows, valid = _chunk_rows(chunk_start_ptr, chunk_end_ptr, c, BT)
    t = tl.arange(0, BT)
    gc, gtot = _chunk_gates(g_ptr + h, rows, valid, H, GATED, BT)
    ck = tl.arange(0, BK)
    q = _load_rows_raw(q_ptr + h * K, rows, valid, H * K, 0, ck, K)
    k = _load_rows_raw(k_ptr + h * K, rows, valid, H * K, 0, ck, K)
    b = tl.load(b_ptr + rows * H + h, mask=valid, other=0.0).to(tl.float32)
    inv = tl.load(t_ptr + rows[:, None] * (H * BT) + h * BT + t[None, :],
                  mask=valid[:, None] & (t[None, :] <= t[:, None]), other=0.0)
    # T's rows from a bad key, beta or gate on are NaN in the recurrence (_solve computed them without it): so
    # are the gradients that read them, as the float64 recurrence's are
    inv = tl.where(t[:, None] >= tl.load(bad_ptr + c * H + h), float("nan"), inv)
    inv_t = _operand(tl.trans(inv), q, PREC)
    decay = _decay_mask(gc, BT)
    eg, to_end = tl.exp(gc), tl.exp(gtot - gc)
    kg = k.to(tl.float32) * eg[:, None]
    part = (c * H + h).to(tl.int64) * K * V
    dq = tl.zeros((BT, BK), tl.float32)
    dk_end = tl.zeros((BT, BK), tl.float32)  # u dS_c^T: the end state's key factor
    dw = tl.zeros((BT, BK), tl.float32)
    dp = tl.zeros((BT, BT), tl.float32)  # do u^T
    dt = tl.zeros((BT, BT), tl.float32)
    db = tl.zeros((BT,), tl.float32)
    dg_q = tl.zeros((BT,), tl.float32)  # do . (q S_c)
    ds_s = tl.sum(tl.zeros((BT,), tl.float32), 0)  # <dS_c, S_c>
    for v0 in range(0, V, BV):
        cv = v0 + tl.arange(0, BV)
        tile_mask = (ck[:, None] < K) & (cv[None, :] < V)
        tile = ck[:, None] * V + cv[None, :]
        do = _load_rows_raw(do_ptr + h * V, rows, valid, H * V, 0, cv, V)
        v = _load_rows_raw(v_ptr + h * V, rows, valid, H * V, 0, cv, V)
        u = _load_rows_raw(un_ptr + h * V, rows, valid, H * V, 0, cv, V)
        du = _load_rows_raw(du_ptr + h * V, rows, valid, H * V, 0, cv, V)
        s0 = tl.load(states_ptr + part + tile, mask=tile_mask, other=0.0)
        ds = tl.load(dstates_ptr + part + tile, mask=tile_mask, other=0.0)
        s0_op, ds_op, du_op = _operand(s0, q, PREC), _operand(ds, q, PREC), _operand(du, q, PREC)
        dg_q += tl.sum(do.to(tl.float32) * _dot(q, s0_op, PREC), 1)
        ds_s += tl.sum(tl.sum(ds * s0.to(tl.float32), 1), 0)
        dq = _dot(do, tl.trans(s0_op), PREC, dq)
        dp = _dot(do, tl.trans(_operand(u, do, PREC)), PREC, dp)
        dk_end = _dot(_operand(u, q, PREC), tl.trans(ds_op), PREC, dk_end)
        dw = _dot(du_op, tl.trans(s0_op), PREC, dw)
        dv_t = _dot(inv_t, du_op, PREC)  # T^T du
        tl.store(dv_ptr + rows[:, None] * (H * V) + h * V + cv[None, :],
                 (dv_t * b[:, None]).to(dv_ptr.dtype.element_ty), mask=valid[:, None] & (cv[None, :] < V))
        db += tl.sum(dv_t * v.to(tl.float32), 1)
        dt = _dot(du_op, tl.trans(_operand(v.to(tl.float32) * b[:, None], q, PREC)), PREC, dt)
    dw = -dw
    # W = T diag(b) kg
    dt = _dot(_operand(dw, q, PREC), tl.trans(_operand(kg * b[:, None], q, PREC)), PREC, dt)
    dkg = _dot(inv_t, _operand(dw, q, PREC), PREC)  # T^T dW
    kg_term = tl.sum(dkg * kg, 1)
    db += kg_term
    dg = kg_term * b
    dk = dkg * (b * eg)[:, None]
    # A = strict_lower(diag(b) (k k^T) o D), T = (I + A)^-1
    da = -_dot(inv_t, _operand(_dot(_operand(dt, q, PREC), inv_t, PREC), q, PREC), PREC)
    strict = t[None, :] < t[:, None]
    kk = _dot(k, tl.trans(k), PREC)
    da_d = tl.where(strict, da * decay, 0.0)
    db += tl.sum(da_d * kk, 1)
    m = _operand(da_d * b[:, None], q, PREC)
    dk = _dot(m, k, PREC, dk)
    dk = _dot(tl.trans(m), k, PREC, dk)
    y = da_d * kk * b[:, None]
    dg += tl.sum(y, 1) - tl.sum(y, 0)
    # o = scale (exp(G) o (q S_c) + ((q k^T) o D) u)
    dpm = _causal(dp * decay, BT) * scale
    dpm_op = _operand(dpm, q, PREC)
    dq = _dot(dpm_op, k, PREC, dq * (scale * eg)[:, None])
    dk = _dot(tl.trans(dpm_op), q, PREC, dk)
    x = dpm * _dot(q, tl.trans(k), PREC)
    dg += tl.sum(x, 1) - tl.sum(x, 0) + dg_q * scale * eg
    # S_(c+1) = exp(Gc) S_c + (k o exp(Gc - G))^T u
    dk += dk_end * to_end[:, None]
    z = tl.sum(dk_end * k.to(tl.float32) * to_end[:, None], 1)
    last_row = tl.max(tl.where(valid, t, 0), 0)
    dg = dg - z + tl.where(t == last_row, tl.sum(z, 0) + tl.exp(gtot) * ds_s, 0.0)
    dg = tl.where(valid, dg, 0.0)
    dg = tl.sum(dg, 0) - tl.cumsum(dg, 0) + dg
    at = rows[:, None] * (H * K) + h * K + ck[None, :]
    mask = valid[:, None] & (ck[None, :] < K)
    tl.store(dq_ptr + at, dq.to(dq_ptr.dtype.element_ty), mask=mask)
    tl.store(dk_ptr + at, dk.to(dk_ptr.dtype.element_ty), mask=mask)
    tl.store(db_ptr + rows * H + h, db, mask=valid)
    if GATED:
        tl.store(dg_ptr + rows * H + h, dg, mask=valid)


@triton.jit
def _step(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, init_ptr, o_ptr, final_ptr, scale, T, H, K, V, GATED: tl.constexpr,
          HAS_INIT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """Decoding: one [K, BV] state column block of one (sequence, head) in registers across the call's tokens."""
    i_v, bh = tl.program_id(0), tl.program_id(1)
    batch, head = bh // H, bh % H
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
        tok = (batch.to(tl.int64) * T + t) * H + head
        q = tl.load(q_ptr + tok * K + ck, mask=k_ok, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + tok * K + ck, mask=k_ok, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + tok * V + cv, mask=v_ok, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + tok + one).to(tl.float32)
        if GATED:
            g = tl.load(g_ptr + tok + one).to(tl.float32)
            state = tl.exp(tl.where(g < G_FLOOR, G_FLOOR, g))[:, None] * state
        u = b * (v - tl.sum(state * k[:, None], 0))
        state = state + k[:, None] * u[None, :]
        o = scale * tl.sum(state * q[:, None], 0)
        tl.store(o_ptr + tok * V + cv, o.to(o_ptr.dtype.element_ty), mask=v_ok)
    tl.store(final_ptr + tile, state, mask=tile_mask)


# --- launchers ---------------------------------------------------------------------------------------------


def _wy_pass(config, k, v, g, b, table, chunk, prec):
    """(W, U, T): the UT transform of every chunk (_solve, then _wu)."""
    heads, K, V = k.shape[2], k.shape[3], v.shape[3]
    poison, n_chunks = config.poison_outputs, table[4]
    dtype = _state_dtype(k, prec)
    inv = _empty((*k.shape[:3], chunk), dtype, k.device, poison)
    first_bad = torch.empty((n_chunks, heads), dtype=torch.int32, device=k.device)
    gate = g if g is not None else b
    _fast(_solve)[(n_chunks, heads)](k, gate, b, inv, first_bad, table[1], table[2], heads, K, GATED=g is not None,
                                     BT=chunk, BK=min(_SOLVE[1], max(16, _pow2(K))), PREC=prec,
                                     MERGE="tf32" if prec in ("bf16", "fp16", "tf32") else "tf32x3",
                                     num_warps=_SOLVE[0])
    w = _empty(k.shape, dtype, k.device, poison)
    u = _empty(v.shape, dtype, v.device, poison)
    _fast(_wu)[(n_chunks, heads)](k, v, gate, b, inv, first_bad, w, u, table[1], table[2], heads, K, V,
                                  GATED=g is not None, BT=chunk, BC=_WU[0], PREC=prec, num_warps=_WU[1])
    return w, u, inv, first_bad


def _column_block(config, V):
    return min(config.scan_tiles[1], max(16, _pow2(V)))


def _scan_columns(config, V, sequences_heads, device):
    """Value columns per forward scan program: _column_block's, halved while the programs would fill at most half
    of the GPU's multiprocessors (the columns are independent; H100, T 16k: H 8 scan 392 us at 32 columns
    against 532 at 64, H 16 558 at 64 against 802 at 32; bench/log/2026-11-27-issue33-s5.md)."""
    bv = _column_block(config, V)
    while bv > 16 and 2 * sequences_heads * triton.cdiv(V, bv) <= sm_count(device, 132):
        bv //= 2
    return bv


# Launch shapes: the fastest of the sweeps in bench/log/2026-11-27-issue33.md (H100, T 16k, H 16, D 128). Limits
# found there: 3 stages need 224-352 KB of shared memory in the scans and the gradients for fp32 operands (the
# H100 has 227 KB); the gradients kernel at 16 warps reads shared memory out of bounds (Triton 3.6,
# compute-sanitizer), so it runs 8.
_RSCAN = (8, 2)  # warps, stages of the reverse scan
_SCAN = (4, 3, 2)  # warps, stages for 16-bit operands, for fp32 ones (3 need 224 KB there)
_OUTPUT = (64, 128, 4, 2)  # key rows and value columns per block, warps, stages
# warps, key columns per step: one warp reduces the [16, 16] blocks fastest (H100, T 16k, H 16: 508 us; 547 with 64
# columns, 773 and 912 with two warps; bench/log/2026-11-27-issue33.md)
_SOLVE = (1, 32)
_WU = (64, 4)  # columns per block, warps


def _scan_pass(config, k, w, u, g, s_init, table, chunk, prec, final):
    first, start, end, n_seq, n_chunks, _ = table
    heads, K, V = k.shape[2], k.shape[3], u.shape[3]
    bv = _scan_columns(config, V, n_seq * heads, k.device)
    poison = config.poison_outputs
    states = _empty((n_chunks, heads, K, V), _state_dtype(k, prec), k.device, poison)
    un = _empty(u.shape, _state_dtype(k, prec), u.device, poison)
    s_fin = _empty((n_seq, heads, K, V), torch.float32, k.device, poison) if final else states
    flags = torch.zeros((n_chunks, heads, triton.cdiv(V, bv)), dtype=torch.int32, device=k.device)
    _fast(_scan)[(triton.cdiv(V, bv), n_seq * heads)](
        k, w, u, g if g is not None else u, s_init if s_init is not None else states, states, un, s_fin, flags, first,
        start, end, heads, K, V, GATED=g is not None, HAS_INIT=s_init is not None, STORE_FINAL=final, BT=chunk,
        BK=max(16, _pow2(K)), BV=bv, PREC=prec, num_warps=_SCAN[0], num_stages=_SCAN[1 if prec in ("bf16", "fp16")
                                                                                          else 2])
    return states, un, (s_fin if final else None), flags


def forward(config, q, k, v, g, b, s_init, cu_seqlens, scale, chunk, final):
    B, T, heads, _ = q.shape
    K, V, bk = _head_dims(q, v)
    table = chunk_table(B, T, cu_seqlens, chunk, q.device)
    prec = precision(config, q.dtype)
    w, u, _, _ = _wy_pass(config, k, v, g, b, table, chunk, prec)
    states, un, s_fin, flags = _scan_pass(config, k, w, u, g, s_init, table, chunk, prec, final)
    o = _empty((*q.shape[:3], V), v.dtype, v.device, config.poison_outputs)
    bk_out, bv, warps, stages = _OUTPUT
    bv = min(bv, max(16, _pow2(V)))
    _fast(_output)[(triton.cdiv(V, bv), table[4], heads)](
        q, k, g if g is not None else b, states, un, flags, o, table[1], table[2], float(scale), heads, K, V,
        flags.shape[2], GATED=g is not None, BT=chunk, BK=min(bk, bk_out), BV=bv, PREC=prec,
        FLAGS=max(2, _pow2(flags.shape[2])), num_warps=warps, num_stages=stages)
    return o, s_fin


def backward(config, do, ds_fin, q, k, v, g, b, s_init, cu_seqlens, scale, chunk):
    """(dq, dk, dv, dg, db, ds_init); dg None without a gate, ds_init None without s_init."""
    B, T, heads, _ = q.shape
    K, V, bk = _head_dims(q, v)
    table = chunk_table(B, T, cu_seqlens, chunk, q.device)
    first, start, end, n_seq, n_chunks, _ = table
    prec = grad_precision(config, q.dtype)
    do = do.contiguous()
    poison = config.poison_outputs
    w, u, inv, first_bad = _wy_pass(config, k, v, g, b, table, chunk, prec)
    states, un, _, _ = _scan_pass(config, k, w, u, g, s_init, table, chunk, prec, False)
    bv = min(32, _column_block(config, V))
    dstates = _empty((n_chunks, heads, K, V), torch.float32, q.device, poison)
    du = _empty(v.shape, torch.float32, v.device, poison)
    ds_init = _empty((n_seq, heads, K, V), torch.float32, q.device, poison) if s_init is not None else None
    gate = g if g is not None else b
    _fast(_rscan)[(triton.cdiv(V, bv), n_seq * heads)](
        q, k, w, gate, do, ds_fin if ds_fin is not None else dstates, dstates, du,
        ds_init if ds_init is not None else dstates, first, start, end, float(scale), heads, K, V,
        GATED=g is not None, HAS_DFINAL=ds_fin is not None, STORE_DINIT=s_init is not None, BT=chunk, BK=bk, BV=bv,
        PREC=prec, num_warps=_RSCAN[0], num_stages=_RSCAN[1])
    dq = _empty(q.shape, q.dtype, q.device, poison)
    dk = _empty(k.shape, k.dtype, k.device, poison)
    dv = _empty(v.shape, v.dtype, v.device, poison)
    db = _empty(b.shape, torch.float32, b.device, poison)
    dg = _empty(g.shape, torch.float32, g.device, poison) if g is not None else db
    # fp32 inputs' operands (fp32 tiles, tf32x3 splits) need 256-260 KB of shared memory at 8 warps, over the
    # H100's 227 KB; 4 warps and 16 columns need 128-224 KB (sm_90, Triton 3.6, K = 128)
    wide = q.dtype != torch.float32
    _fast(_grads)[(n_chunks, heads)](q, k, v, gate, b, do, inv, first_bad, states, dstates, un, du, dq, dk, dv, db, dg,
                                     start, end, float(scale), heads, K, V, GATED=g is not None, BT=chunk, BK=bk,
                                     BV=min(32 if wide else 16, max(16, _pow2(V))), PREC=prec,
                                     num_warps=8 if wide else 4, num_stages=1)
    return dq, dk, dv, (dg.to(g.dtype) if g is not None else None), db.to(b.dtype), ds_init


def recurrent(config, q, k, v, g, b, s_init, scale):
    B, T, heads, _ = q.shape
    K, V, bk = _head_dims(q, v)
    q, k, v, b = (t.contiguous() for t in (q, k, v, b))
    g = g.contiguous() if g is not None else b
    o = _empty((B, T, heads, V), v.dtype, v.device, config.poison_outputs)
    s_fin = torch.empty((B, heads, K, V), dtype=torch.float32, device=q.device)
    bv = min(32, max(16, _pow2(V)))
    _fast(_step)[(triton.cdiv(V, bv), B * heads)](
        q, k, v, g, b, s_init.contiguous() if s_init is not None else s_fin, o, s_fin, float(scale), T, heads, K, V,
        GATED=g is not b, HAS_INIT=s_init is not None, BK=bk, BV=bv, num_warps=4)
    return o, s_fin
