"""Factorized (chunked) form of a normalized contraction whose a1, a2 are polynomials of degree <= 1, <= 2 in the
score (factorize.py), written once; it reuses the streamed kernels' inner loops (kernel.py) for
the diagonal chunks. The coefficients enter as constexprs C0, C1, E0, E1, E2 (NEED_VEC: c0 or e1 is non-zero, so the
column sums of the states' value rows are kept too); the maps and flags as in kernel.py.

    a1(s) = c0 + c1 s,  a2(s) = e0 + e1 s + e2 s^2  (s = scale q.k)

so, with w_j the per-key weight (1 without one) and the sums over the keys visible to query i,

    numerator_i = c0 sum_j w_j v_j + c1 scale q_i S,          S = sum_j w_j k_j v_j^T  [D, D]
    z_i         = e0 sum_j w_j + e1 scale q_i . sum_j w_j k_j + e2 scale^2 q_i^T M q_i,  M = sum_j w_j k_j k_j^T

Causal: keys are cut into chunks of CHUNK. State t holds S and M (and the vector sums) over the keys of chunks < t (a
sequential scan per kv head: `fact_state_fwd_kernel`); a query block of chunk t adds the keys of its own chunk as
masked scores, exactly as the streamed kernel does on its diagonal blocks. No mask: one state per kv head over all
keys; the [query key] matrix is never formed.

Backward: with g_i = dO_i / b(z_i) and delta_i = (dO_i . o_i) b'(z_i) / b(z_i),

    dQ_i = scale [c1 g_i S^T - e1 delta_i sum_j w_j k_j - 2 e2 scale delta_i q_i M]       (+ own chunk)
    dK_j = scale w_j [c1 v_j A^T - e1 u - 2 e2 scale k_j B],   dV_j = w_j [c0 sum_i g_i + c1 scale k_j A]

with A = sum_i q_i^T g_i, B = sum_i delta_i q_i^T q_i, u = sum_i delta_i q_i over the queries that see key j (causal:
in later chunks, a reverse scan: `fact_state_bwd_kernel`), summed over the query heads of a kv head. States are
[D, 2D] per chunk and kv head, stored in the input dtype (accumulated in fp32); the vector sums, when needed, fp32.
"""
# ruff: noqa: E741, SIM102, SIM108
# (kernels: tensors named O; constexpr branches written as statements, which Triton resolves at compile time)

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from ncd.families.attention.config import GPU_CHUNK, INTERPRET_CHUNK
from ncd.families.attention.kernel import (
    _INTERPRET,
    HOOK_KEY,
    AttentionConfig,
    AttentionKernels,
    Spec,
    _bwd_dkdv_inner,
    _bwd_dq_inner,
    _dot,
    _finish_rows,
    _fwd_inner,
    _head,
    _head_columns,
    _in_head,
    _inv_b,
    _key_block_program,
    _load_key_block,
    _load_rows,
    _query_head,
    _row_delta,
    _store_key_block,
    _store_rows,
    autotuned,
    bucket,
    head_tile,
    weight_arg,
)
from ncd.launch import fast

# (BLOCK_M, BLOCK_N, num_warps, num_stages) for the tile kernels; (BK, BV, num_warps, num_stages) for the
# scans, which own a BK x BV block of a [D, 2D] state
GPU_TILES: dict[str, tuple[tuple[int, int, int, int], ...]] = {
    "state": ((64, 64, 4, 2), (128, 64, 8, 2), (64, 64, 4, 3), (128, 128, 8, 2)),
    "fwd": ((128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 8, 2)),
    "dq": ((128, 64, 8, 2), (128, 32, 8, 2), (64, 64, 8, 2)),
    "dkdv": ((32, 64, 8, 2), (32, 128, 8, 2), (64, 64, 8, 2)),
}


def _fact_configs(kind: str) -> list:
    names = ("BK", "BV") if kind == "state" else ("BLOCK_M", "BLOCK_N")
    if _INTERPRET:
        return [triton.Config({names[0]: 16, names[1]: 16}, num_warps=4, num_stages=1)]
    return [triton.Config({names[0]: c[0], names[1]: c[1]}, num_warps=c[2], num_stages=c[3]) for c in GPU_TILES[kind]]


def _fact_prune_state(configs: list, named_args: dict, **kwargs: Any) -> list:
    d = kwargs["HEAD_DIM"]  # constexpr arguments arrive as keywords
    kept = [c for c in configs if c.kwargs["BK"] <= d and c.kwargs["BV"] <= d]
    return kept or [triton.Config({"BK": min(16, d), "BV": min(16, d)}, num_warps=4, num_stages=1)]


def _fact_prune(configs: list, named_args: dict, **kwargs: Any) -> list:
    """Tiles no longer than the (bucketed) lengths; with the causal chunks, tiles that divide CHUNK."""
    chunk, causal = kwargs["CHUNK"], kwargs["CAUSAL"]
    q_bucket, k_bucket = named_args["Q_BUCKET"], named_args["K_BUCKET"]
    kept = [c for c in configs if c.kwargs["BLOCK_M"] <= q_bucket and c.kwargs["BLOCK_N"] <= k_bucket
            and (not causal or (chunk % c.kwargs["BLOCK_M"] == 0 and chunk % c.kwargs["BLOCK_N"] == 0))]
    if kept:
        return kept
    side = max(16, min(chunk, 64)) if causal else 64
    return [triton.Config({"BLOCK_M": side, "BLOCK_N": side}, num_warps=4, num_stages=1)]


FACT_STATE_KEY = ["HEAD_DIM", "CHUNK", "PRECISION", "STORE_ALL", "STEPS_BUCKET", "HEADS_BUCKET", *HOOK_KEY]
FACT_TUNE_KEY = ["HEAD_DIM", "PRECISION", "CHUNK", "Q_BUCKET", "K_BUCKET", "WORK", *HOOK_KEY]

# ---------------------------------------------------------------------------------------------
# Forward state: S = sum_j w_j k_j v_j^T and M = sum_j w_j k_j k_j^T as one [D, 2D] matrix K_w^T [V | K]
# ---------------------------------------------------------------------------------------------


@triton.jit
def _state_program(H, VEC, HQ, GROUP, N_STATES, HEAD_DIM: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """(pid_c, pid_r, bhk, off_b, off_hk, col0, offs_r, offs_c, h_ptrs, vec_ptrs) of a program of a scan's grid over
    (column block of the [D, 2D] states, row block, batch * kv head), HQ // GROUP kv heads: h_ptrs, vec_ptrs point
    at its block of the first state of its kv head."""
    pid_c = tl.program_id(0)
    pid_r = tl.program_id(1)
    bhk = tl.program_id(2)
    hkv = HQ // GROUP
    off_b = bhk // hkv
    off_hk = bhk % hkv
    col0 = pid_c * BV
    offs_r = pid_r * BK + tl.arange(0, BK)
    offs_c = tl.arange(0, BV)
    state = bhk.to(tl.int64) * N_STATES
    h_ptrs = H + state * (2 * HEAD_DIM * HEAD_DIM) + offs_r[:, None] * (2 * HEAD_DIM) + col0 + offs_c[None, :]
    vec_ptrs = VEC + state * (2 * HEAD_DIM) + col0 + offs_c
    return pid_c, pid_r, state, off_b, off_hk, col0, offs_r, offs_c, h_ptrs, vec_ptrs


@triton.jit
def _total_row(TOT, bhk, HEAD_DIM: tl.constexpr):
    """A (batch, kv head)'s row of fp32 totals (total_width: the state [D, 2D], then its vector sums [2D], then its
    weight sum): pointers to its state, vector sums and weight sum."""
    row = TOT + bhk.to(tl.int64) * (2 * HEAD_DIM * HEAD_DIM + 4 * HEAD_DIM)
    return row, row + 2 * HEAD_DIM * HEAD_DIM, row + 2 * HEAD_DIM * HEAD_DIM + 2 * HEAD_DIM


@triton.jit
def _total_ptrs(TOT, HEAD_DIM: tl.constexpr, col0, offs_r, offs_c):
    """A scan program's block of its (batch, kv head)'s total row (_total_row): state, vector sums, weight sum."""
    h, vec, w = _total_row(TOT, tl.program_id(2), HEAD_DIM)
    return h + offs_r[:, None] * (2 * HEAD_DIM) + col0 + offs_c[None, :], vec + col0 + offs_c, w


@triton.jit
def _store_state(h_ptrs, vec_ptrs, wsum_ptr, h, vec, wsum, STORE_VEC, STORE_W, NEED_VEC: tl.constexpr,
                 E0: tl.constexpr):
    """A scan program's block of a state in the pointers' dtype, its vector sums and weight sum where this program
    owns them (STORE_VEC, STORE_W) and the coefficients need them."""
    tl.store(h_ptrs, h.to(h_ptrs.dtype.element_ty))
    if NEED_VEC:
        if STORE_VEC:
            tl.store(vec_ptrs, vec)
    if E0 != 0.0:
        if STORE_W:
            tl.store(wsum_ptr, wsum)


@triton.jit
def _fact_scan_fwd(
    h_ptrs, h_step, vec_ptrs, vec_step, wsum_ptr, wsum_step, tot_ptrs, tot_vec_ptrs, tot_w_ptr, k_base, x_base,
    w_base, stride_kn, stride_kd, stride_xn, stride_xd, stride_wn, offs_r, offs_c, r_ok, c_ok, N_K, N_STATES, N_STEPS,
    STORE_VEC, STORE_W,
    STORE_ALL: tl.constexpr, STORE_TOTAL: tl.constexpr, CHUNK: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    PRECISION: tl.constexpr, HAS_WEIGHT: tl.constexpr, NEED_VEC: tl.constexpr, E0: tl.constexpr,
):
    """h = sum over chunks of K_w[chunk, rows]^T X[chunk, cols]; with STORE_ALL the state before each chunk
    is stored (state t: keys of chunks < t; the state after the last step too where there is room for it), else
    the total once. STORE_TOTAL: the total in fp32 as well (tot_*: context parallelism's totals). r_ok, c_ok: which
    rows and columns exist (the state is the head-dim tile wide; K, X are D wide)."""
    offs_t = tl.arange(0, CHUNK)
    h = tl.zeros([BK, BV], dtype=tl.float32)
    vec = tl.zeros([BV], dtype=tl.float32)
    wsum = tl.sum(tl.zeros([CHUNK], dtype=tl.float32), 0)
    for t in range(N_STEPS):
        if STORE_ALL:
            _store_state(h_ptrs + t * h_step, vec_ptrs + t * vec_step, wsum_ptr + t * wsum_step, h, vec, wsum,
                         STORE_VEC, STORE_W, NEED_VEC, E0)
        offs_n = t * CHUNK + offs_t
        in_k = offs_n < N_K
        kk = _load_rows(k_base, offs_n, stride_kn, stride_kd, offs_r, in_k, r_ok)
        x = _load_rows(x_base, offs_n, stride_xn, stride_xd, offs_c, in_k, c_ok)
        if HAS_WEIGHT:
            w = tl.load(w_base + offs_n * stride_wn, mask=in_k, other=0.0)
            xw = x.to(tl.float32) * w[:, None]
            x = xw.to(x.dtype)
        else:
            w = in_k.to(tl.float32)
            xw = x.to(tl.float32)
        h = _dot(tl.trans(kk), x, h, PRECISION)
        if NEED_VEC:
            vec += tl.sum(xw, 0)
        if E0 != 0.0:
            wsum += tl.sum(w, 0)
    if STORE_ALL:
        last = N_STEPS
    else:
        last = 0
    if last < N_STATES:
        _store_state(h_ptrs + last * h_step, vec_ptrs + last * vec_step, wsum_ptr + last * wsum_step, h, vec, wsum,
                     STORE_VEC, STORE_W, NEED_VEC, E0)
    if STORE_TOTAL:
        _store_state(tot_ptrs, tot_vec_ptrs, tot_w_ptr, h, vec, wsum, STORE_VEC, STORE_W, NEED_VEC, E0)


@triton.jit
def fact_state_fwd_kernel(
    K, V, W, H, VEC, WSUM, TOT,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_wb, stride_wn,
    HKV, N_K, N_STATES, N_STEPS, STEPS_BUCKET, HEADS_BUCKET,
    HEAD_DIM: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr, STORE_ALL: tl.constexpr,
    STORE_TOTAL: tl.constexpr, PRECISION: tl.constexpr,
    A1: tl.constexpr, A2: tl.constexpr, DA1: tl.constexpr, DA2: tl.constexpr, B: tl.constexpr,
    DB_OVER_B: tl.constexpr, PRE: tl.constexpr, DPRE: tl.constexpr,
    SCORE: tl.constexpr, DSCORE: tl.constexpr, SCORE_GRADS: tl.constexpr, MASK: tl.constexpr,
    KEY_RANGE: tl.constexpr, QUERY_RANGE: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, ONLINE_MAX: tl.constexpr, EXP2: tl.constexpr,
    SAME_A: tl.constexpr, HAS_PRE: tl.constexpr, HAS_SCORE: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_SCORE_GRADS: tl.constexpr, FOLD: tl.constexpr,
    C0: tl.constexpr, C1: tl.constexpr, E0: tl.constexpr, E1: tl.constexpr, E2: tl.constexpr, NEED_VEC: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
):
    """One program per (column block of [V | K], row block of D, batch * kv head)."""
    pid_c, pid_r, state, off_b, off_hk, col0, offs_r, offs_c, h_ptrs, vec_ptrs = _state_program(
        H, VEC, HKV, 1, N_STATES, HEAD_DIM, BK, BV)
    tot_ptrs, tot_vec_ptrs, tot_w_ptr = _total_ptrs(TOT, HEAD_DIM, col0, offs_r, offs_c)
    k_base = _head(K, off_b, off_hk, stride_kb, stride_kh)
    w_base = W + off_b.to(tl.int64) * stride_wb
    store_vec = pid_r == 0
    store_w = (pid_r == 0) & (pid_c == 0)
    r_ok = _in_head(offs_r, HEAD_DIM, D)
    if col0 < HEAD_DIM:  # value columns: S
        c_ok = _in_head(col0 + offs_c, HEAD_DIM, D)
        v_base = _head(V, off_b, off_hk, stride_vb, stride_vh) + col0 * stride_vd
        _fact_scan_fwd(
            h_ptrs, 2 * HEAD_DIM * HEAD_DIM, vec_ptrs, 2 * HEAD_DIM, WSUM + state, 1, tot_ptrs, tot_vec_ptrs,
            tot_w_ptr, k_base, v_base, w_base, stride_kn, stride_kd, stride_vn, stride_vd, stride_wn,
            offs_r, offs_c, r_ok, c_ok, N_K, N_STATES, N_STEPS, store_vec, store_w, STORE_ALL, STORE_TOTAL, CHUNK, BK,
            BV, PRECISION, HAS_WEIGHT, NEED_VEC, E0,
        )
    else:  # key columns: M
        x_base = k_base + (col0 - HEAD_DIM) * stride_kd
        c_ok = _in_head(col0 - HEAD_DIM + offs_c, HEAD_DIM, D)
        _fact_scan_fwd(
            h_ptrs, 2 * HEAD_DIM * HEAD_DIM, vec_ptrs, 2 * HEAD_DIM, WSUM + state, 1, tot_ptrs, tot_vec_ptrs,
            tot_w_ptr, k_base, x_base, w_base, stride_kn, stride_kd, stride_kn, stride_kd, stride_wn,
            offs_r, offs_c, r_ok, c_ok, N_K, N_STATES, N_STEPS, store_vec, False, STORE_ALL, STORE_TOTAL, CHUNK, BK,
            BV, PRECISION, HAS_WEIGHT, NEED_VEC, E0,
        )


# ---------------------------------------------------------------------------------------------
# Forward output: one program per (query block, batch * query head)
# ---------------------------------------------------------------------------------------------


@triton.jit
def _fact_query_program(HQ, GROUP, BLOCK_M: tl.constexpr):
    """(bh, bhk, off_b, off_h, off_hk, start_m, offs_m) of a program of a grid over (query block, batch * query head),
    as kernel.py's `_query_block_program` (no reversal, no axis swap) with bhk, the (batch, kv head) index, too."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    off_b = bh // HQ
    off_h = bh % HQ
    off_hk = off_h // GROUP
    bhk = off_b * (HQ // GROUP) + off_hk
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    return bh, bhk, off_b, off_h, off_hk, start_m, offs_m


@triton.jit
def _state_block(base, inc_base, offsets, HAS_INCOMING: tl.constexpr):
    """A block of a stored state (its dtype) plus, under context parallelism, the same block of the fp32 totals that
    the other ranks' segments add to every state of this (batch, kv head): summed in fp32, rounded once."""
    x = tl.load(base + offsets)
    if HAS_INCOMING:
        x = (x.to(tl.float32) + tl.load(inc_base + offsets)).to(x.dtype)
    return x


@triton.jit
def _state_sums(base, inc_base, offsets, HAS_INCOMING: tl.constexpr):
    """The fp32 vector sums (or weight sum) of a state, plus the incoming totals' (see _state_block)."""
    x = tl.load(base + offsets)
    if HAS_INCOMING:
        x += tl.load(inc_base + offsets)
    return x


@triton.jit
def fact_fwd_kernel(
    Q, K, V, W, H, VEC, WSUM, O, Z, INC,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_wb, stride_wn,
    scale, HQ, GROUP, N_Q, N_K, N_STATES, Q_BUCKET, K_BUCKET, WORK,
    HEAD_DIM: tl.constexpr, D: tl.constexpr, PRECISION: tl.constexpr, CHUNK: tl.constexpr, UNIT_SCALE: tl.constexpr,
    A1: tl.constexpr, A2: tl.constexpr, DA1: tl.constexpr, DA2: tl.constexpr, B: tl.constexpr,
    DB_OVER_B: tl.constexpr, PRE: tl.constexpr, DPRE: tl.constexpr,
    SCORE: tl.constexpr, DSCORE: tl.constexpr, SCORE_GRADS: tl.constexpr, MASK: tl.constexpr,
    KEY_RANGE: tl.constexpr, QUERY_RANGE: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, ONLINE_MAX: tl.constexpr, EXP2: tl.constexpr,
    SAME_A: tl.constexpr, HAS_PRE: tl.constexpr, HAS_SCORE: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_SCORE_GRADS: tl.constexpr, FOLD: tl.constexpr,
    C0: tl.constexpr, C1: tl.constexpr, E0: tl.constexpr, E1: tl.constexpr, E2: tl.constexpr, NEED_VEC: tl.constexpr,
    HAS_INCOMING: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    S: tl.constexpr = Spec(A1, A2, DA1, DA2, B, DB_OVER_B, PRE, DPRE, SCORE, DSCORE, SCORE_GRADS, MASK,
                           KEY_RANGE, QUERY_RANGE, CAUSAL, HAS_WEIGHT, ONLINE_MAX, EXP2, SAME_A, HAS_PRE,
                           HAS_SCORE, HAS_MASK, HAS_SCORE_GRADS, FOLD)
    bh, bhk, off_b, off_h, off_hk, start_m, offs_m = _fact_query_program(HQ, GROUP, BLOCK_M)
    offs_d, d_ok = _head_columns(HEAD_DIM, D)
    in_q = offs_m < N_Q
    q = _load_rows(_head(Q, off_b, off_h, stride_qb, stride_qh), offs_m, stride_qm, stride_qd, offs_d, in_q, d_ok)
    if CAUSAL:
        t = start_m // CHUNK  # state t: the keys of chunks < t
    else:
        t = 0
    state = bhk.to(tl.int64) * N_STATES + t
    h_base = H + state * (2 * HEAD_DIM * HEAD_DIM)
    inc_h, inc_vec, inc_w = _total_row(INC, bhk, HEAD_DIM)
    z = tl.zeros([BLOCK_M], dtype=tl.float32)
    if E2 != 0.0:
        mm = _state_block(h_base, inc_h, offs_d[:, None] * (2 * HEAD_DIM) + HEAD_DIM + offs_d[None, :], HAS_INCOMING)
        qm = _dot(q, mm, None, PRECISION)
        z += (E2 * scale * scale) * tl.sum(qm * q.to(tl.float32), 1)
    if C1 != 0.0:
        ss = _state_block(h_base, inc_h, offs_d[:, None] * (2 * HEAD_DIM) + offs_d[None, :], HAS_INCOMING)
        acc = _dot(q, ss, None, PRECISION) * (C1 * scale)
    else:
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if NEED_VEC:
        vec_base = VEC + state * (2 * HEAD_DIM)
    if E1 != 0.0:
        kw = _state_sums(vec_base, inc_vec, HEAD_DIM + offs_d, HAS_INCOMING)
        z += (E1 * scale) * tl.sum(q.to(tl.float32) * kw[None, :], 1)
    if C0 != 0.0:
        acc += C0 * _state_sums(vec_base, inc_vec, offs_d, HAS_INCOMING)[None, :]
    if E0 != 0.0:
        z += E0 * _state_sums(WSUM + state, inc_w, 0, HAS_INCOMING)
    if CAUSAL:
        # the keys of the own chunk up to the diagonal, as scores (unmasked blocks, then masked ones)
        k_base = _head(K, off_b, off_hk, stride_kb, stride_kh)
        v_base = _head(V, off_b, off_hk, stride_vb, stride_vh)
        w_base = W + off_b.to(tl.int64) * stride_wb
        lo = t * CHUNK
        hi = tl.minimum(start_m + BLOCK_M, N_K)
        full_end = tl.maximum(lo, tl.minimum((start_m + 1) // BLOCK_N * BLOCK_N, N_K // BLOCK_N * BLOCK_N))
        m = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc, z, m = _fwd_inner(acc, z, m, q, k_base, v_base, w_base, stride_kn, stride_kd, stride_vn, stride_vd,
                               stride_wn, offs_m, lo, full_end, hi, N_K, scale, off_b, off_hk, off_h, (), BLOCK_N,
                               HEAD_DIM, D, HEAD_DIM, D, PRECISION, False, UNIT_SCALE, False, S)
    o = _finish_rows(acc, z, in_q, B)
    _store_rows(_head(O, off_b, off_h, stride_ob, stride_oh), o, offs_m, stride_om, stride_od, offs_d, in_q, d_ok)
    tl.store(Z + bh.to(tl.int64) * N_Q + offs_m, z, mask=in_q)


# ---------------------------------------------------------------------------------------------
# Backward dQ (and delta): one program per (query block, batch * query head)
# ---------------------------------------------------------------------------------------------


@triton.jit
def fact_dq_kernel(
    Q, K, V, W, DO, O, Z, H, VEC, DELTA, DQ, INC,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    stride_wb, stride_wn,
    scale, HQ, GROUP, N_Q, N_K, N_STATES, Q_BUCKET, K_BUCKET, WORK,
    HEAD_DIM: tl.constexpr, D: tl.constexpr, PRECISION: tl.constexpr, CHUNK: tl.constexpr,
    A1: tl.constexpr, A2: tl.constexpr, DA1: tl.constexpr, DA2: tl.constexpr, B: tl.constexpr,
    DB_OVER_B: tl.constexpr, PRE: tl.constexpr, DPRE: tl.constexpr,
    SCORE: tl.constexpr, DSCORE: tl.constexpr, SCORE_GRADS: tl.constexpr, MASK: tl.constexpr,
    KEY_RANGE: tl.constexpr, QUERY_RANGE: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, ONLINE_MAX: tl.constexpr, EXP2: tl.constexpr,
    SAME_A: tl.constexpr, HAS_PRE: tl.constexpr, HAS_SCORE: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_SCORE_GRADS: tl.constexpr, FOLD: tl.constexpr,
    C0: tl.constexpr, C1: tl.constexpr, E0: tl.constexpr, E1: tl.constexpr, E2: tl.constexpr, NEED_VEC: tl.constexpr,
    HAS_INCOMING: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    S: tl.constexpr = Spec(A1, A2, DA1, DA2, B, DB_OVER_B, PRE, DPRE, SCORE, DSCORE, SCORE_GRADS, MASK,
                           KEY_RANGE, QUERY_RANGE, CAUSAL, HAS_WEIGHT, ONLINE_MAX, EXP2, SAME_A, HAS_PRE,
                           HAS_SCORE, HAS_MASK, HAS_SCORE_GRADS, FOLD)
    bh, bhk, off_b, off_h, off_hk, start_m, offs_m = _fact_query_program(HQ, GROUP, BLOCK_M)
    offs_d, d_ok = _head_columns(HEAD_DIM, D)
    in_q = offs_m < N_Q
    q_base = _head(Q, off_b, off_h, stride_qb, stride_qh)
    do_base = _head(DO, off_b, off_h, stride_dob, stride_doh)
    o_base = _head(O, off_b, off_h, stride_ob, stride_oh)
    q = _load_rows(q_base, offs_m, stride_qm, stride_qd, offs_d, in_q, d_ok)
    do = _load_rows(do_base, offs_m, stride_dom, stride_dod, offs_d, in_q, d_ok)
    o = _load_rows(o_base, offs_m, stride_om, stride_od, offs_d, in_q, d_ok)
    stat_offs = bh.to(tl.int64) * N_Q + offs_m
    z = tl.load(Z + stat_offs, mask=in_q, other=1.0)
    inv_b = _inv_b(z, B)
    delta = _row_delta(o, do, z, DB_OVER_B)
    tl.store(DELTA + stat_offs, delta, mask=in_q)
    if CAUSAL:
        t = start_m // CHUNK
    else:
        t = 0
    state = bhk.to(tl.int64) * N_STATES + t
    h_base = H + state * (2 * HEAD_DIM * HEAD_DIM)
    inc_h, inc_vec, _inc_w = _total_row(INC, bhk, HEAD_DIM)
    if C1 != 0.0:
        g = (do.to(tl.float32) * inv_b[:, None]).to(do.dtype)
        st = _state_block(h_base, inc_h, offs_d[None, :] * (2 * HEAD_DIM) + offs_d[:, None], HAS_INCOMING)  # S^T
        dq = _dot(g, st, None, PRECISION)
        if C1 != 1.0:
            dq = dq * C1
    else:
        dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if E2 != 0.0:
        mm = _state_block(h_base, inc_h, offs_d[:, None] * (2 * HEAD_DIM) + HEAD_DIM + offs_d[None, :], HAS_INCOMING)
        q_delta = (q.to(tl.float32) * (((-2.0 * E2) * scale) * delta)[:, None]).to(q.dtype)
        dq = _dot(q_delta, mm, dq, PRECISION)
    if E1 != 0.0:
        kw = _state_sums(VEC + state * (2 * HEAD_DIM), inc_vec, HEAD_DIM + offs_d, HAS_INCOMING)
        dq -= E1 * delta[:, None] * kw[None, :]
    if CAUSAL:
        k_base = _head(K, off_b, off_hk, stride_kb, stride_kh)
        v_base = _head(V, off_b, off_hk, stride_vb, stride_vh)
        w_base = W + off_b.to(tl.int64) * stride_wb
        lo = t * CHUNK
        hi = tl.minimum(start_m + BLOCK_M, N_K)
        full_end = tl.maximum(lo, tl.minimum((start_m + 1) // BLOCK_N * BLOCK_N, N_K // BLOCK_N * BLOCK_N))
        dq = _bwd_dq_inner(dq, q, do, 0.0, inv_b, delta, k_base, v_base, w_base, stride_kn, stride_kd, stride_vn,
                           stride_vd, stride_wn, offs_m, lo, full_end, hi, N_K, scale, off_b, off_hk, off_h, (),
                           BLOCK_N, HEAD_DIM, D, HEAD_DIM, D, PRECISION, False, S)
    dq = dq * scale
    _store_rows(_head(DQ, off_b, off_h, stride_dqb, stride_dqh), dq, offs_m, stride_dqm, stride_dqd, offs_d, in_q, d_ok)


# ---------------------------------------------------------------------------------------------
# Backward state: A = sum_i q_i^T g_i and B = sum_i delta_i q_i^T q_i as one [D, 2D] matrix
# Q^T [G | delta Q], summed over the query heads of a kv head
# ---------------------------------------------------------------------------------------------


@triton.jit
def _fact_scan_bwd(
    h_ptrs, h_step, vec_ptrs, vec_step, tot_ptrs, tot_vec_ptrs, Q, DO, Z, DELTA, off_b, off_hk, cols,
    stride_qb, stride_qh, stride_qm, stride_qd, stride_dob, stride_doh, stride_dom, stride_dod,
    offs_r, r_ok, c_ok, HQ, GROUP, N_Q, N_STATES, N_STEPS, STORE_VEC,
    IS_G: tl.constexpr, STORE_ALL: tl.constexpr, STORE_TOTAL: tl.constexpr, CHUNK: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, PRECISION: tl.constexpr, B: tl.constexpr, NEED_VEC: tl.constexpr,
):
    """Reverse scan over query chunks; with STORE_ALL, state t (for the keys of chunk t) holds the queries of
    chunks > t and is stored for t < N_STATES, else the total is stored once. STORE_TOTAL: the total over all the
    queries in fp32 as well (tot_*: context parallelism's totals)."""
    offs_t = tl.arange(0, CHUNK)
    h = tl.zeros([BK, BV], dtype=tl.float32)
    vec = tl.zeros([BV], dtype=tl.float32)
    for step in range(N_STEPS):
        t = N_STEPS - 1 - step
        if STORE_ALL:
            if t < N_STATES:
                tl.store(h_ptrs + t * h_step, h.to(h_ptrs.dtype.element_ty))
                if NEED_VEC:
                    if STORE_VEC:
                        tl.store(vec_ptrs + t * vec_step, vec)
        offs_m = t * CHUNK + offs_t
        in_q = offs_m < N_Q
        for g in range(GROUP):
            off_h = off_hk * GROUP + g
            q_base = _head(Q, off_b, off_h, stride_qb, stride_qh)
            qr = _load_rows(q_base, offs_m, stride_qm, stride_qd, offs_r, in_q, r_ok)
            stat_offs = (off_b * HQ + off_h).to(tl.int64) * N_Q + offs_m
            if IS_G:
                do_base = _head(DO, off_b, off_h, stride_dob, stride_doh)
                x = _load_rows(do_base, offs_m, stride_dom, stride_dod, cols, in_q, c_ok)
                inv_b = _inv_b(tl.load(Z + stat_offs, mask=in_q, other=1.0), B)
                xs = x.to(tl.float32) * inv_b[:, None]
            else:
                x = _load_rows(q_base, offs_m, stride_qm, stride_qd, cols, in_q, c_ok)
                xs = x.to(tl.float32) * tl.load(DELTA + stat_offs, mask=in_q, other=0.0)[:, None]
            h = _dot(tl.trans(qr), xs.to(qr.dtype), h, PRECISION)
            if NEED_VEC:
                vec += tl.sum(xs, 0)
    if not STORE_ALL:
        tl.store(h_ptrs, h.to(h_ptrs.dtype.element_ty))
        if NEED_VEC:
            if STORE_VEC:
                tl.store(vec_ptrs, vec)
    if STORE_TOTAL:
        tl.store(tot_ptrs, h)
        if NEED_VEC:
            if STORE_VEC:
                tl.store(tot_vec_ptrs, vec)


@triton.jit
def fact_state_bwd_kernel(
    Q, DO, Z, DELTA, H, VEC, TOT,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    HQ, GROUP, N_Q, N_STATES, N_STEPS, STEPS_BUCKET, HEADS_BUCKET,
    HEAD_DIM: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr, STORE_ALL: tl.constexpr,
    STORE_TOTAL: tl.constexpr, PRECISION: tl.constexpr,
    A1: tl.constexpr, A2: tl.constexpr, DA1: tl.constexpr, DA2: tl.constexpr, B: tl.constexpr,
    DB_OVER_B: tl.constexpr, PRE: tl.constexpr, DPRE: tl.constexpr,
    SCORE: tl.constexpr, DSCORE: tl.constexpr, SCORE_GRADS: tl.constexpr, MASK: tl.constexpr,
    KEY_RANGE: tl.constexpr, QUERY_RANGE: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, ONLINE_MAX: tl.constexpr, EXP2: tl.constexpr,
    SAME_A: tl.constexpr, HAS_PRE: tl.constexpr, HAS_SCORE: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_SCORE_GRADS: tl.constexpr, FOLD: tl.constexpr,
    C0: tl.constexpr, C1: tl.constexpr, E0: tl.constexpr, E1: tl.constexpr, E2: tl.constexpr, NEED_VEC: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
):
    """One program per (column block of [G | delta Q], row block of D, batch * kv head)."""
    _, pid_r, _, off_b, off_hk, col0, offs_r, offs_c, h_ptrs, vec_ptrs = _state_program(
        H, VEC, HQ, GROUP, N_STATES, HEAD_DIM, BK, BV)
    tot_ptrs, tot_vec_ptrs, _tot_w = _total_ptrs(TOT, HEAD_DIM, col0, offs_r, offs_c)
    store_vec = pid_r == 0
    r_ok = _in_head(offs_r, HEAD_DIM, D)
    if col0 < HEAD_DIM:  # G = dO / b(z) columns: A
        c_ok = _in_head(col0 + offs_c, HEAD_DIM, D)
        _fact_scan_bwd(
            h_ptrs, 2 * HEAD_DIM * HEAD_DIM, vec_ptrs, 2 * HEAD_DIM, tot_ptrs, tot_vec_ptrs, Q, DO, Z, DELTA, off_b,
            off_hk, col0 + offs_c, stride_qb, stride_qh, stride_qm, stride_qd, stride_dob, stride_doh, stride_dom,
            stride_dod, offs_r, r_ok, c_ok, HQ, GROUP, N_Q, N_STATES, N_STEPS, store_vec, True, STORE_ALL, STORE_TOTAL,
            CHUNK, BK, BV, PRECISION, B, NEED_VEC,
        )
    else:  # delta * Q columns: B
        c_ok = _in_head(col0 - HEAD_DIM + offs_c, HEAD_DIM, D)
        _fact_scan_bwd(
            h_ptrs, 2 * HEAD_DIM * HEAD_DIM, vec_ptrs, 2 * HEAD_DIM, tot_ptrs, tot_vec_ptrs, Q, DO, Z, DELTA, off_b,
            off_hk, col0 - HEAD_DIM + offs_c, stride_qb, stride_qh, stride_qm, stride_qd, stride_dob, stride_doh,
            stride_dom, stride_dod, offs_r, r_ok, c_ok, HQ, GROUP, N_Q, N_STATES, N_STEPS,
            store_vec, False, STORE_ALL, STORE_TOTAL, CHUNK, BK, BV, PRECISION, B, NEED_VEC,
        )


# ---------------------------------------------------------------------------------------------
# Backward dK, dV: one program per (key block, batch * kv head)
# ---------------------------------------------------------------------------------------------


@triton.jit
def fact_dkdv_kernel(
    Q, K, V, W, DO, Z, DELTA, HB, VECB, DK, DV, INC,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    stride_wb, stride_wn,
    scale, HQ, HKV, GROUP, N_Q, N_K, N_STATES, Q_BUCKET, K_BUCKET, WORK,
    HEAD_DIM: tl.constexpr, D: tl.constexpr, PRECISION: tl.constexpr, CHUNK: tl.constexpr,
    A1: tl.constexpr, A2: tl.constexpr, DA1: tl.constexpr, DA2: tl.constexpr, B: tl.constexpr,
    DB_OVER_B: tl.constexpr, PRE: tl.constexpr, DPRE: tl.constexpr,
    SCORE: tl.constexpr, DSCORE: tl.constexpr, SCORE_GRADS: tl.constexpr, MASK: tl.constexpr,
    KEY_RANGE: tl.constexpr, QUERY_RANGE: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, ONLINE_MAX: tl.constexpr, EXP2: tl.constexpr,
    SAME_A: tl.constexpr, HAS_PRE: tl.constexpr, HAS_SCORE: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_SCORE_GRADS: tl.constexpr, FOLD: tl.constexpr,
    C0: tl.constexpr, C1: tl.constexpr, E0: tl.constexpr, E1: tl.constexpr, E2: tl.constexpr, NEED_VEC: tl.constexpr,
    HAS_INCOMING: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    S: tl.constexpr = Spec(A1, A2, DA1, DA2, B, DB_OVER_B, PRE, DPRE, SCORE, DSCORE, SCORE_GRADS, MASK,
                           KEY_RANGE, QUERY_RANGE, CAUSAL, HAS_WEIGHT, ONLINE_MAX, EXP2, SAME_A, HAS_PRE,
                           HAS_SCORE, HAS_MASK, HAS_SCORE_GRADS, FOLD)
    bhk, off_b, off_hk, _, start_n, offs_n = _key_block_program(HKV, BLOCK_N, False)
    offs_d, d_ok = _head_columns(HEAD_DIM, D)
    in_k = offs_n < N_K
    k, v, w = _load_key_block(K, V, W, off_b, off_hk, offs_n, offs_d, d_ok, offs_d, d_ok, in_k, stride_kb, stride_kh,
                              stride_kn, stride_kd, stride_vb, stride_vh, stride_vn, stride_vd, stride_wb, stride_wn,
                              HAS_WEIGHT)
    if CAUSAL:
        t = start_n // CHUNK  # state t: the queries of chunks > t
    else:
        t = 0
    # the queries of the state first: dK, dV start as these products (scaled afterwards, so no operand
    # is rounded again), then the own chunk's scores accumulate into them
    state = bhk.to(tl.int64) * N_STATES + t
    h_base = HB + state * (2 * HEAD_DIM * HEAD_DIM)
    inc_h, inc_vec, _inc_w = _total_row(INC, bhk, HEAD_DIM)
    if C1 != 0.0:
        a = _state_block(h_base, inc_h, offs_d[:, None] * (2 * HEAD_DIM) + offs_d[None, :], HAS_INCOMING)  # A
        dv = _dot(k, a, None, PRECISION) * (C1 * scale)
    else:
        dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    if E2 != 0.0:
        bm = _state_block(h_base, inc_h, offs_d[:, None] * (2 * HEAD_DIM) + HEAD_DIM + offs_d[None, :],
                          HAS_INCOMING)  # B
        dk = _dot(k, bm, None, PRECISION) * ((-2.0 * E2) * scale)
    else:
        dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    if C1 != 0.0:
        at = _state_block(h_base, inc_h, offs_d[None, :] * (2 * HEAD_DIM) + offs_d[:, None], HAS_INCOMING)  # A^T
        if C1 == 1.0:
            dk = _dot(v, at, dk, PRECISION)
        else:
            dk = _dot((v.to(tl.float32) * C1).to(v.dtype), at, dk, PRECISION)
    if NEED_VEC:
        vec_base = VECB + state * (2 * HEAD_DIM)
    if E1 != 0.0:
        dk -= E1 * _state_sums(vec_base, inc_vec, HEAD_DIM + offs_d, HAS_INCOMING)[None, :]
    if C0 != 0.0:
        dv += C0 * _state_sums(vec_base, inc_vec, offs_d, HAS_INCOMING)[None, :]
    if HAS_WEIGHT:
        dk = dk * w[:, None]
        dv = dv * w[:, None]
    if CAUSAL:
        # the queries of the own chunk at or after the diagonal, as scores
        lo = start_n // BLOCK_M * BLOCK_M
        chunk_end = tl.minimum((t + 1) * CHUNK, N_Q)
        diag_end = tl.minimum((start_n + BLOCK_N - 1 + BLOCK_M - 1) // BLOCK_M * BLOCK_M,
                              (N_Q + BLOCK_M - 1) // BLOCK_M * BLOCK_M)  # as _query_blocks, in this order
        for g in range(GROUP):
            off_h, _, q_base, do_base, stat_base = _query_head(Q, DO, off_b, off_hk, g, stride_qb, stride_qh,
                                                               stride_dob, stride_doh, HQ, GROUP, N_Q, False)
            dk, dv = _bwd_dkdv_inner(
                dk, dv, k, v, w, in_k, q_base, do_base, Z + stat_base, Z + stat_base, DELTA + stat_base,
                stride_qm, stride_qd, stride_dom, stride_dod, start_n, lo, diag_end, chunk_end, N_Q, N_K, scale,
                off_b, off_h, DK, 0, 0, (), (), BLOCK_M, BLOCK_N, HEAD_DIM, D, HEAD_DIM, D, PRECISION, False, False,
                False, S,
            )
    dk = dk * scale
    _store_key_block(DK, DV, dk, dv, off_b, off_hk, offs_n, offs_d, d_ok, offs_d, d_ok, in_k, stride_dkb, stride_dkh,
                     stride_dkn, stride_dkd, stride_dvb, stride_dvh, stride_dvn, stride_dvd)


# ---------------------------------------------------------------------------------------------
# Context parallelism: the incoming sums from every rank's segment totals
# ---------------------------------------------------------------------------------------------


@triton.jit
def _place(rank, segment, WORLD, CAUSAL: tl.constexpr):
    """A segment's place among all ranks' pieces: the zigzag's chunks rank and 2 P - 1 - rank, or the rank (as
    ring.py's _places, on the host)."""
    if CAUSAL:
        return tl.where(segment == 0, rank, 2 * WORLD - 1 - rank)
    return rank


@triton.jit
def incoming_sums_kernel(GATHERED, INC, WIDTH, BATCH, WORLD, RANK, SEGMENTS: tl.constexpr, CAUSAL: tl.constexpr,
                         BEFORE: tl.constexpr, BLOCK: tl.constexpr):
    """INC[b, s] = the sum of GATHERED[p, b, s'] over every rank p's segments s' that reach this rank's segment s
    (causal: placed before it, or after it for the backward's; else every other rank's), WIDTH floats each. One
    program per (block of WIDTH, batch * segment); the sum runs in rank and segment order on every rank."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_row = offs < WIDTH
    b = tl.program_id(1) // SEGMENTS
    mine = _place(RANK, tl.program_id(1) % SEGMENTS, WORLD, CAUSAL)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for p in range(WORLD):
        for s in range(SEGMENTS):
            other = _place(p, s, WORLD, CAUSAL)
            if CAUSAL:
                if BEFORE:
                    reach = other < mine
                else:
                    reach = other > mine
            else:
                reach = other != mine
            if reach:
                row = ((p * BATCH + b) * SEGMENTS + s).to(tl.int64) * WIDTH
                acc += tl.load(GATHERED + row + offs, mask=in_row, other=0.0)
    tl.store(INC + tl.program_id(1).to(tl.int64) * WIDTH + offs, acc, mask=in_row)


# ---------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------


def total_width(tile: int) -> int:
    """Floats in a (batch, kv head)'s row of totals (_total_row): the state, its vector sums, its weight sum."""
    return 2 * tile * tile + 4 * tile


def incoming_sums(gathered: torch.Tensor, batch: int, segments: int, world: int, rank: int, causal: bool,
                  before: bool) -> torch.Tensor:
    """The incoming sums for this rank's segments ([batch * segments, width] fp32) from every rank's segment totals,
    gathered in rank order: [world * batch * segments * width] (incoming_sums_kernel)."""
    width = gathered.numel() // (world * batch * segments)
    out = torch.empty((batch * segments, width), dtype=torch.float32, device=gathered.device)
    block = 1024

    def grid(meta: dict) -> tuple:
        return (triton.cdiv(width, block), batch * segments)

    fast(incoming_sums_kernel)[grid](gathered, out, width, batch, world, rank, SEGMENTS=segments, CAUSAL=causal,
                                     BEFORE=before, BLOCK=block)
    return out


def _same_widths(head_dim: int, v: torch.Tensor) -> None:
    """The factorized form's states are [D, 2D]: V as wide as Q and K (the planner offers the form only to specs
    whose V width is the head dim's)."""
    if v.shape[3] != head_dim:
        raise ValueError(f"the factorized form needs V as wide as Q and K ({head_dim}); got V of width {v.shape[3]}: "
                         "use the streamed form (NCD_ATTENTION_FACTORIZE=never)")


class FactorizedAttentionKernels(AttentionKernels):
    """AttentionKernels plus the factorized form: `coefficients` (c0, c1, e0, e1, e2) of a1, a2 as polynomials of the
    score. Keys per causal chunk: `config.chunk`, else the platform's (config.py)."""

    def __init__(self, name: str, config: AttentionConfig, maps: dict[str, Any], namespace: dict[str, Any], *,
                 causal: bool, has_weight: bool, coefficients: tuple[float, float, float, float, float]) -> None:
        super().__init__(name, config, maps, namespace, causal=causal, has_weight=has_weight)
        c0, c1, e0, e1, e2 = (float(c) for c in coefficients)
        self.need_vec = bool(c0 or e1)
        self.has_wsum = bool(e0)
        self.fact_spec = {**self.spec, "C0": c0, "C1": c1, "E0": e0, "E1": e1, "E2": e2, "NEED_VEC": self.need_vec}
        self.chunk = config.chunk or (INTERPRET_CHUNK if _INTERPRET else GPU_CHUNK)
        self.fact_state_fwd_kernel = autotuned(fact_state_fwd_kernel, _fact_configs("state"), FACT_STATE_KEY,
                                               _fact_prune_state)
        self.fact_state_bwd_kernel = autotuned(fact_state_bwd_kernel, _fact_configs("state"), FACT_STATE_KEY,
                                               _fact_prune_state)
        self.fact_fwd_kernel = autotuned(fact_fwd_kernel, _fact_configs("fwd"), FACT_TUNE_KEY, _fact_prune)
        self.fact_dq_kernel = autotuned(fact_dq_kernel, _fact_configs("dq"), FACT_TUNE_KEY, _fact_prune)
        self.fact_dkdv_kernel = autotuned(fact_dkdv_kernel, _fact_configs("dkdv"), FACT_TUNE_KEY, _fact_prune)

    def states(self, n_q: int, n_k: int, chunk: int) -> tuple[int, int, int, int]:
        """(forward states, forward scan steps, backward states, backward scan steps)."""
        if not self.causal:
            return 1, triton.cdiv(n_k, chunk), 1, triton.cdiv(n_q, chunk)
        n_fwd = triton.cdiv(n_q, chunk)  # state t: keys of chunks < t, for each query chunk
        n_bwd = triton.cdiv(n_k, chunk)  # state t: queries of chunks > t, for each key chunk
        return n_fwd, n_fwd - 1, n_bwd, max(triton.cdiv(n_q, chunk), n_bwd)

    def key_states(self, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor | None, n_states: int, n_steps: int,
                   store_all: bool, dtype: torch.dtype, totals: bool = False) -> tuple:
        """(h, vec, wsum) of the keys: [B * Hkv, n_states, tile, 2 tile] in dtype, the vector sums and weight sums
        fp32 (None where the coefficients need none); store_all: the state before each chunk (causal), else the
        total over all keys once. totals: ((h, vec, wsum), their totals over all n_steps chunks in fp32, one row
        per batch * kv head: [B * Hkv, total_width(tile)]), what context parallelism sends."""
        batch, hkv, n_k, head_dim = k.shape
        tile = head_tile(head_dim)  # the states are tile x 2 tile: the columns past head_dim stay zero
        h = self.new((batch * hkv, n_states, tile, 2 * tile), dtype, k.device)
        vec = self.new((batch * hkv, n_states, 2 * tile), torch.float32, k.device) if self.need_vec else None
        wsum = self.new((batch * hkv, n_states), torch.float32, k.device) if self.has_wsum else None
        tot = self.new((batch * hkv, total_width(tile)), torch.float32, k.device) if totals else None
        w_arg, w_strides = weight_arg(w, k)

        def grid_state(meta: dict) -> tuple:
            return (2 * tile // meta["BV"], tile // meta["BK"], batch * hkv)

        # (h stands in for the vector sums and the weight sums where the coefficients need none)
        fast(self.fact_state_fwd_kernel)[grid_state](
            k, v, w_arg, h, h if vec is None else vec, h if wsum is None else wsum, h if tot is None else tot,
            *k.stride(), *v.stride(), *w_strides, hkv, n_k, n_states, n_steps, bucket(n_steps), bucket(batch * hkv),
            HEAD_DIM=tile, D=head_dim, CHUNK=self.chunk, STORE_ALL=store_all, STORE_TOTAL=totals,
            PRECISION=self.precision(k.dtype), **self.fact_spec,
        )
        return ((h, vec, wsum), tot) if totals else (h, vec, wsum)

    def forward_factorized(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor | None = None,
                           scale: float | None = None) -> tuple:
        """o as `forward` computes it, by the factorized form; returns (o, (z, h, vec)) for backward_factorized."""
        _, _, _, n_q, n_k, head_dim = self.shapes(q, k, v, w)
        _same_widths(head_dim, v)
        limit = self.config.fact_max_head_dim
        if head_tile(head_dim) > limit:
            raise ValueError(f"the factorized form runs head dims up to {limit} (its [D, D] states are held "
                             f"in shared memory); got {head_dim}: use the streamed form (NCD_ATTENTION_FACTORIZE=auto)")
        scale = head_dim**-0.5 if scale is None else float(scale)
        chunk = self.chunk
        n_states, n_steps, _, _ = self.states(n_q, n_k, chunk)
        h, vec, wsum = self.key_states(k, v, w, n_states, n_steps, self.causal, q.dtype)
        o, z = self.factorized_output(q, k, v, w, scale, h, vec, wsum)
        return o, (z, h, vec)

    def factorized_output(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor | None,
                          scale: float, h: torch.Tensor, vec: torch.Tensor | None, wsum: torch.Tensor | None,
                          out: torch.Tensor | None = None, incoming: torch.Tensor | None = None) -> tuple:
        """(o, z) from the keys' states (`key_states`: query chunk t reads state t). out: o's storage (any
        strides), else a new tensor. incoming: fp32 sums, a row per batch * kv head as key_states' totals, that every
        state is raised by as the kernel reads it (context parallelism: the other ranks' segments before these)."""
        batch, hq, hkv, n_q, n_k, head_dim = self.shapes(q, k, v, w)
        w_arg, w_strides = weight_arg(w, q)
        o = self.new((batch, hq, n_q, head_dim), q.dtype, q.device) if out is None else out
        z = self.new((batch, hq, n_q), torch.float32, q.device)

        def grid(meta: dict) -> tuple:
            return (triton.cdiv(n_q, meta["BLOCK_M"]), batch * hq)

        fast(self.fact_fwd_kernel)[grid](
            q, k, v, w_arg, h, h if vec is None else vec, h if wsum is None else wsum, o, z,
            h if incoming is None else incoming,
            *q.stride(), *k.stride(), *v.stride(), *o.stride(), *w_strides,
            scale, hq, hq // hkv, n_q, n_k, h.shape[1], bucket(n_q), bucket(n_k), bucket(batch * hq),
            HEAD_DIM=head_tile(head_dim), D=head_dim, PRECISION=self.precision(q.dtype), CHUNK=self.chunk,
            UNIT_SCALE=scale == 1.0, HAS_INCOMING=incoming is not None, **self.fact_spec,
        )
        return o, z

    def backward_factorized(self, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            o: torch.Tensor, stats: tuple, w: torch.Tensor | None = None,
                            scale: float | None = None) -> tuple:
        """(dq, dk, dv) of <do, o>; stats as returned by forward_factorized."""
        dq, delta = self.factorized_dq(do, q, k, v, o, stats, w, scale)
        n_states_b, n_steps_b = self.states(q.shape[2], k.shape[2], self.chunk)[2:]
        hb, vecb = self.query_states(q, do, stats[0], delta, k.shape[1], n_states_b, n_steps_b, self.causal, q.dtype)
        dk, dv = self.factorized_dkdv(do, q, k, v, stats[0], delta, hb, vecb, w, scale)
        return dq, dk, dv

    def factorized_dq(self, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                      stats: tuple, w: torch.Tensor | None = None, scale: float | None = None,
                      out: torch.Tensor | None = None, incoming: torch.Tensor | None = None) -> tuple:
        """(dq, delta): the first half of backward_factorized (delta: fp32 [B, Hq, N_Q], what the rest reads).
        out: dq's storage, else a new tensor. incoming: as factorized_output's."""
        batch, hq, hkv, n_q, n_k, head_dim = self.shapes(q, k, v, w)
        _same_widths(head_dim, v)
        scale = head_dim**-0.5 if scale is None else float(scale)
        z, h, vec = stats
        n_states = self.states(n_q, n_k, self.chunk)[0]
        if h.shape[1] != n_states:
            raise ValueError(f"stats were computed with another CHUNK ({h.shape[1]} states, {n_states} expected)")
        w_arg, w_strides = weight_arg(w, q)
        if do.dtype != q.dtype:
            do = do.to(q.dtype)
        delta = self.new((batch, hq, n_q), torch.float32, q.device)
        dq = self.new(q.shape, q.dtype, q.device) if out is None else out

        def grid_q(meta: dict) -> tuple:
            return (triton.cdiv(n_q, meta["BLOCK_M"]), batch * hq)

        fast(self.fact_dq_kernel)[grid_q](
            q, k, v, w_arg, do, o, z, h, h if vec is None or not self.need_vec else vec, delta, dq,
            h if incoming is None else incoming,
            *q.stride(), *k.stride(), *v.stride(), *do.stride(), *o.stride(), *dq.stride(), *w_strides,
            scale, hq, hq // hkv, n_q, n_k, h.shape[1], bucket(n_q), bucket(n_k), bucket(batch * hq),
            HEAD_DIM=head_tile(head_dim), D=head_dim, PRECISION=self.precision(q.dtype), CHUNK=self.chunk,
            HAS_INCOMING=incoming is not None, **self.fact_spec,
        )
        return dq, delta

    def query_states(self, q: torch.Tensor, do: torch.Tensor, z: torch.Tensor, delta: torch.Tensor, hkv: int,
                     n_states: int, n_steps: int, store_all: bool, dtype: torch.dtype, totals: bool = False) -> tuple:
        """(hb [B * Hkv, n_states, tile, 2 tile] in dtype, vecb fp32 or None) of the queries, summed over the query
        heads of each of the hkv kv heads (the backward's reverse scan; store_all: the state after each chunk,
        causal; else the total once). totals: ((hb, vecb), their fp32 totals over all the queries, in rows as
        key_states')."""
        batch, hq, n_q, head_dim = q.shape
        tile = head_tile(head_dim)
        if do.dtype != q.dtype:
            do = do.to(q.dtype)
        hb = self.new((batch * hkv, n_states, tile, 2 * tile), dtype, q.device)
        vecb = self.new((batch * hkv, n_states, 2 * tile), torch.float32, q.device) if self.need_vec else None
        tot = self.new((batch * hkv, total_width(tile)), torch.float32, q.device) if totals else None

        def grid_state(meta: dict) -> tuple:
            return (2 * tile // meta["BV"], tile // meta["BK"], batch * hkv)

        fast(self.fact_state_bwd_kernel)[grid_state](
            q, do, z, delta, hb, hb if vecb is None else vecb, hb if tot is None else tot, *q.stride(),
            *do.stride(), hq, hq // hkv, n_q, n_states, n_steps, bucket(n_steps), bucket(batch * hkv),
            HEAD_DIM=tile, D=head_dim, CHUNK=self.chunk, STORE_ALL=store_all, STORE_TOTAL=totals,
            PRECISION=self.precision(q.dtype), **self.fact_spec,
        )
        return ((hb, vecb), tot) if totals else (hb, vecb)

    def factorized_dkdv(self, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, z: torch.Tensor,
                        delta: torch.Tensor, hb: torch.Tensor, vecb: torch.Tensor | None, w: torch.Tensor | None = None,
                        scale: float | None = None, out: tuple | None = None,
                        incoming: torch.Tensor | None = None) -> tuple:
        """(dk, dv) from the queries' states (query_states): the rest of backward_factorized. out: (dk, dv)'s
        storage, else new tensors. incoming: fp32 sums that every state is raised by (factorized_output's)."""
        batch, hq, hkv, n_q, n_k, head_dim = self.shapes(q, k, v, w)
        scale = head_dim**-0.5 if scale is None else float(scale)
        w_arg, w_strides = weight_arg(w, q)
        if do.dtype != q.dtype:
            do = do.to(q.dtype)
        if out is None:
            dk, dv = self.new(k.shape, k.dtype, k.device), self.new(v.shape, v.dtype, v.device)
        else:
            dk, dv = out

        def grid_k(meta: dict) -> tuple:
            return (triton.cdiv(n_k, meta["BLOCK_N"]), batch * hkv)

        fast(self.fact_dkdv_kernel)[grid_k](
            q, k, v, w_arg, do, z, delta, hb, hb if vecb is None else vecb, dk, dv,
            hb if incoming is None else incoming,
            *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(), *w_strides,
            scale, hq, hkv, hq // hkv, n_q, n_k, hb.shape[1], bucket(n_q), bucket(n_k), bucket(batch * hq),
            HEAD_DIM=head_tile(head_dim), D=head_dim, PRECISION=self.precision(q.dtype), CHUNK=self.chunk,
            HAS_INCOMING=incoming is not None, **self.fact_spec,
        )
        return dk, dv

    def factorized_backward_from_saved(self, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                       w: torch.Tensor | None, o: torch.Tensor, z: torch.Tensor, h: torch.Tensor,
                                       vec: torch.Tensor | None, scale: float | None) -> tuple:
        """backward_factorized() from the tensors `save_for_backward` keeps (vec: None or empty when not needed)."""
        run: Callable = self.ns["backward_factorized"]
        return run(do, q, k, v, o, (z, h, vec if self.need_vec else None), w, scale)
