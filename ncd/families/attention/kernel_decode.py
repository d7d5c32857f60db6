"""Split-K decoding (flash-decoding) for the attention family: few queries (N_Q 1..16) against a long key sequence.

The standard forward (kernel.py's `fwd_kernel`) runs one program per (query block, batch * query head) and walks the
whole key axis; with one query per head that is batch * heads programs, too few to fill the GPU, each reading K and V
of its kv head again for every query head of the group. Here:

- `decode_split_kernel`, grid (splits, batch * kv heads): a program packs ALL query rows of the GROUP query heads that
  share one K/V head into one tile of GROUP * N_Q rows (padded to a power of two, at least 16), so K and V are read
  once per kv head, and accumulates the key range [split * SPLIT_KEYS, (split + 1) * SPLIT_KEYS) only, with kernel.py's
  `_fwd_inner` (the same hooks and flags: maps, score and mask modifiers, weights, causal, the running max, EXP2).
  Packed row r is query i = r % N_Q of head kv_head * GROUP + r // N_Q; the hooks see that (i, head), the same
  position convention as `fwd_kernel` (i in [0, N_Q), j in [0, N_K)). It stores the split's partial state
  (acc, z, m); with one split it finishes the rows itself (no combine).
- `decode_combine_kernel`, grid (batch * kv heads,): merges the partials by the certificate. With the running max,
  m* = max_s m_s, z = sum_s z_s a2(m_s - m*), acc = sum_s acc_s a1(m_s - m*) (the rescale of `_fwd_block`; exp2 of
  base-2 maxima with EXP2), else plain sums; then o = acc / b(z) (`_finish_rows`: a row with z = 0 is 0) and O, Z, M
  stored as `fwd_kernel` stores them (M in natural units; a row that saw no key gets 0), so the backward kernels run
  unchanged from the saved statistics.

`decode_forward(kernels, q, k, v, w, scale, context)` is `AttentionKernels.forward` on this path (same arguments, same
returns); `use_decode(n_q, n_k, batch_heads)` says when it pays.
"""
# ruff: noqa: E741, SIM108
# (kernels: tensors named O; constexpr branches written as statements, which Triton resolves at compile time)

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from ncd.families.attention.kernel import (
    _INTERPRET,
    AttentionKernels,
    Spec,
    _finish_rows,
    _fwd_inner,
    _head,
    _head_columns,
    _load_rows,
    _segments,
    _store_rows,
    _store_stats,
    _value_columns,
    descriptor,
    head_tile,
    weight_arg,
)
from ncd.launch import fast
from ncd.launch import sm_count as _sm_count

# When the decode path pays (`use_decode`): at most this many queries per head ...
DECODE_MAX_QUERIES = 16
# ... against at least this many keys (below, the combine's launch and the partials cost more than splitting saves) ...
DECODE_MIN_KEYS = 1024
# ... and few query tiles: the standard forward's programs (batch * query heads at N_Q <= 16) fill at most this many
# waves of the GPU's SMs
DECODE_MAX_WAVES = 2
# How many splits (`decode_splits`): one program per SM over the batch * kv heads tiles (measured, H100, q = 1,
# KV = 32k, B = 8, bf16: 128 tiles ran best unsplit, 0.697 ms against 0.720 at 5 splits; 32 tiles (GQA 4) best at
# 4 splits, 0.196 ms against 0.213 at 16: a stream already at the memory bandwidth gains nothing from more programs,
# and each split adds partial states to write and combine), each split at least MIN_SPLIT_BLOCKS key blocks, at most
# MAX_SPLITS
PROGRAMS_PER_SM = 1
MIN_SPLIT_BLOCKS = 4
MAX_SPLITS = 128
NUM_WARPS, NUM_STAGES = 4, 3  # the split kernel's launch (bench/decode.py --sweep: the best at q = 1, KV = 32k)
USE_TMA = False  # K and V by pointers: bulk copies measured no faster (bench/decode.py --sweep)
CPU_SMS = 132  # the SM count assumed off the GPU (an H100's), so that the interpreter takes the GPU's decisions

def sm_count(device: torch.device | None = None) -> int:
    """Streaming multiprocessors of `device` (the current CUDA device when None); CPU_SMS off CUDA."""
    return _sm_count(device, CPU_SMS)


def use_decode(n_q: int, n_k: int, batch_heads: int, sms: int | None = None) -> bool:
    """Whether the split-K decode path should run instead of the standard forward: at most DECODE_MAX_QUERIES (16)
    queries per head, at least DECODE_MIN_KEYS (1024) keys, and the standard forward's query tiles (one per
    batch * query head at such N_Q) fill at most DECODE_MAX_WAVES (2) waves of the `sms` streaming multiprocessors
    (`sm_count()` when None). batch_heads: batch * query heads."""
    sms = sm_count() if sms is None else sms
    return 1 <= n_q <= DECODE_MAX_QUERIES and n_k >= DECODE_MIN_KEYS and batch_heads <= DECODE_MAX_WAVES * sms


def decode_block_n(head_dim_tile: int) -> int:
    """Keys per block of the split kernel: 16 on the interpreter (cheap odd-size tests), else 64 (32 past a 128-wide
    head tile, for the registers of the [BLOCK_N, HEAD_DIM] tiles)."""
    if _INTERPRET:
        return 16
    return 64 if head_dim_tile <= 128 else 32


def decode_splits(n_k: int, kv_programs: int, block_n: int, sms: int) -> int:
    """Splits of the key axis: PROGRAMS_PER_SM programs per SM over the kv_programs (batch * kv heads) tiles, each
    split at least MIN_SPLIT_BLOCKS key blocks, at most MAX_SPLITS; at least 1."""
    blocks = triton.cdiv(n_k, block_n)
    want = PROGRAMS_PER_SM * sms // max(kv_programs, 1)
    return max(1, min(want, blocks // MIN_SPLIT_BLOCKS, MAX_SPLITS))


def packed_rows(group: int, n_q: int) -> int:
    """The tile of one kv head's query rows: GROUP * N_Q rounded up to a power of two, at least 16 (tl.dot)."""
    return max(16, triton.next_power_of_2(group * n_q))


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _packed_rows(off_hk, N_Q, GROUP, BLOCK_M: tl.constexpr):
    """(r, i, g, off_h, rows_ok) of the packed tile of kv head off_hk: row r is query i = r % N_Q of group member
    g = r // N_Q, query head off_h = off_hk * GROUP + g; rows_ok: r < GROUP * N_Q. The padding rows past it repeat
    the last head's rows (valid positions for the hooks; never stored)."""
    r = tl.arange(0, BLOCK_M)
    rows_ok = r < GROUP * N_Q
    g = tl.minimum(r // N_Q, GROUP - 1)
    i = r % N_Q
    return r, i, g, off_hk * GROUP + g, rows_ok


@triton.jit
def _row_offsets(g, i, stride_h, stride_n):
    """Element offsets of the packed rows (group member g, query i) from head off_hk * GROUP's plane: one offset per
    row, so that kernel.py's `_load_rows` / `_store_rows` take them with a row stride of 1."""
    return g.to(tl.int64) * stride_h + i.to(tl.int64) * stride_n


@triton.jit
def _store_rows_stats(O, Z, M, o, z, m, off_b, off_hk, g, i, off_h, rows_ok, offs_dv, dv_ok,
                      stride_ob, stride_oh, stride_om, stride_od, HQ, GROUP, N_Q,
                      ONLINE_MAX: tl.constexpr, EXP2: tl.constexpr):
    """O, Z and M of the packed rows as `fwd_kernel` stores them (m: the running max in the kernels' units, base 2
    with EXP2; M in natural units)."""
    o_base = _head(O, off_b, off_hk * GROUP, stride_ob, stride_oh)
    _store_rows(o_base, o, _row_offsets(g, i, stride_oh, stride_om), 1, stride_od, offs_dv, rows_ok, dv_ok)
    _store_stats(Z, M, (off_b.to(tl.int64) * HQ + off_h) * N_Q + i, z, m, rows_ok, EXP2, ONLINE_MAX)


@triton.jit
def decode_split_kernel(
    Q, K, V, W, O, Z, M, ACC, ZS, MS,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_wb, stride_wn,
    scale, HQ, HKV, GROUP, N_Q, N_K, SPLIT_KEYS, C,
    HEAD_DIM: tl.constexpr, D: tl.constexpr, HEAD_DIM_V: tl.constexpr, DV: tl.constexpr, PRECISION: tl.constexpr,
    NEG_SCALE: tl.constexpr, UNIT_SCALE: tl.constexpr, TMA: tl.constexpr,
    A1: tl.constexpr, A2: tl.constexpr, DA1: tl.constexpr, DA2: tl.constexpr, B: tl.constexpr,
    DB_OVER_B: tl.constexpr, PRE: tl.constexpr, DPRE: tl.constexpr,
    SCORE: tl.constexpr, DSCORE: tl.constexpr, SCORE_GRADS: tl.constexpr, MASK: tl.constexpr,
    KEY_RANGE: tl.constexpr, QUERY_RANGE: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, ONLINE_MAX: tl.constexpr, EXP2: tl.constexpr,
    SAME_A: tl.constexpr, HAS_PRE: tl.constexpr, HAS_SCORE: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_SCORE_GRADS: tl.constexpr, FOLD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FINAL: tl.constexpr,
):
    """One program per (split, batch * kv head): the partial state of keys [split * SPLIT_KEYS, + SPLIT_KEYS) for the
    packed rows, into ACC [B * HKV, splits, BLOCK_M, HEAD_DIM_V], ZS and MS [B * HKV, splits, BLOCK_M] (fp32; m in
    the kernels' units, -inf where the split ran no key block for the row). FINAL (one split): O, Z, M directly.
    TMA: K and V are tensor descriptors (kernel.py's `_load_kv`), Q, O and the rest pointers."""
    S: tl.constexpr = Spec(A1, A2, DA1, DA2, B, DB_OVER_B, PRE, DPRE, SCORE, DSCORE, SCORE_GRADS, MASK,
                           KEY_RANGE, QUERY_RANGE, CAUSAL, HAS_WEIGHT, ONLINE_MAX, EXP2, SAME_A, HAS_PRE,
                           HAS_SCORE, HAS_MASK, HAS_SCORE_GRADS, FOLD)
    pid_s = tl.program_id(0)
    bhk = tl.program_id(1)
    off_b = bhk // HKV
    off_hk = bhk % HKV
    r, i, g, off_h, rows_ok = _packed_rows(off_hk, N_Q, GROUP, BLOCK_M)
    offs_d, d_ok = _head_columns(HEAD_DIM, D)

    q_base = _head(Q, off_b, off_hk * GROUP, stride_qb, stride_qh)
    q = _load_rows(q_base, _row_offsets(g, i, stride_qh, stride_qm), 1, stride_qd, offs_d, rows_ok, d_ok)
    if TMA:  # descriptors of K, V (blocks [1, 1, BLOCK_N, HEAD_DIM(_V)]; rows past N_K read as zeros)
        k_src, v_src = K, V
    else:
        k_src = _head(K, off_b, off_hk, stride_kb, stride_kh)
        v_src = _head(V, off_b, off_hk, stride_vb, stride_vh)
    w_base = W + off_b.to(tl.int64) * stride_wb

    acc = tl.zeros([BLOCK_M, HEAD_DIM_V], dtype=tl.float32)
    z = tl.zeros([BLOCK_M], dtype=tl.float32)
    if ONLINE_MAX:
        m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    else:
        m = tl.zeros([BLOCK_M], dtype=tl.float32)

    # the key blocks the rows see: [start, a) and [b, end) masked, [a, b) whole (kernel.py's `_segments`), then cut
    # to this split's [s0, s1)
    if HAS_MASK:
        lo, full_lo, full_hi, hi = KEY_RANGE(i, off_b, off_h, C)
        start, a, b, end = _segments(lo, full_lo, full_hi, hi, N_K, BLOCK_N)
    elif CAUSAL:  # row i sees keys [0, i]: every row key 0, none past N_Q - 1
        start, a, b, end = _segments(0, 0, 1, N_Q, N_K, BLOCK_N)
    else:
        start, a, b, end = _segments(0, 0, N_K, N_K, N_K, BLOCK_N)
    s0 = pid_s * SPLIT_KEYS
    s1 = s0 + SPLIT_KEYS
    lo1 = tl.maximum(start, s0)
    hi1 = tl.maximum(lo1, tl.minimum(a, s1))
    lo2 = tl.maximum(a, s0)
    mid2 = tl.maximum(lo2, tl.minimum(b, s1))
    hi2 = tl.maximum(mid2, tl.minimum(end, s1))
    # the hooks take the head per row: [BLOCK_M, 1] against the [rows, keys] score tile
    acc, z, m = _fwd_inner(acc, z, m, q, k_src, v_src, w_base, stride_kn, stride_kd, stride_vn, stride_vd,
                           stride_wn, i, lo1, lo1, hi1, N_K, scale, off_b, off_hk, off_h[:, None], C, BLOCK_N,
                           HEAD_DIM, D, HEAD_DIM_V, DV, PRECISION, NEG_SCALE, UNIT_SCALE, TMA, S)
    acc, z, m = _fwd_inner(acc, z, m, q, k_src, v_src, w_base, stride_kn, stride_kd, stride_vn, stride_vd,
                           stride_wn, i, lo2, mid2, hi2, N_K, scale, off_b, off_hk, off_h[:, None], C, BLOCK_N,
                           HEAD_DIM, D, HEAD_DIM_V, DV, PRECISION, NEG_SCALE, UNIT_SCALE, TMA, S)

    offs_dv, dv_ok = _value_columns(offs_d, d_ok, HEAD_DIM, D, HEAD_DIM_V, DV)
    if FINAL:
        if ONLINE_MAX:
            m = tl.where(m == float("-inf"), 0.0, m)  # a row that sees no key: its saved max stays finite
        o = _finish_rows(acc, z, rows_ok, B)
        _store_rows_stats(O, Z, M, o, z, m, off_b, off_hk, g, i, off_h, rows_ok, offs_dv, dv_ok,
                          stride_ob, stride_oh, stride_om, stride_od, HQ, GROUP, N_Q, ONLINE_MAX, EXP2)
    else:
        part = (bhk.to(tl.int64) * tl.num_programs(0) + pid_s) * BLOCK_M + r
        cols = tl.arange(0, HEAD_DIM_V)
        tl.store(ACC + part[:, None] * HEAD_DIM_V + cols[None, :], acc)
        tl.store(ZS + part, z)
        if ONLINE_MAX:
            tl.store(MS + part, m)


@triton.jit
def decode_combine_kernel(
    O, Z, M, ACC, ZS, MS,
    stride_ob, stride_oh, stride_om, stride_od,
    HQ, HKV, GROUP, N_Q, SPLITS,
    HEAD_DIM: tl.constexpr, D: tl.constexpr, HEAD_DIM_V: tl.constexpr, DV: tl.constexpr,
    A1: tl.constexpr, A2: tl.constexpr, B: tl.constexpr, ONLINE_MAX: tl.constexpr, EXP2: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """One program per batch * kv head: the SPLITS partial states of its packed rows merged (the certificate's
    rescale by a1, a2 of m_s - m*; plain sums without the running max), finished and stored as `fwd_kernel` does."""
    bhk = tl.program_id(0)
    off_b = bhk // HKV
    off_hk = bhk % HKV
    r, i, g, off_h, rows_ok = _packed_rows(off_hk, N_Q, GROUP, BLOCK_M)
    cols = tl.arange(0, HEAD_DIM_V)
    first = bhk.to(tl.int64) * SPLITS
    if ONLINE_MAX:
        m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        for s in range(SPLITS):
            m = tl.maximum(m, tl.load(MS + (first + s) * BLOCK_M + r))
        m = tl.where(m == float("-inf"), 0.0, m)  # no split saw a key of the row: its saved max is 0
    else:
        m = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_V], dtype=tl.float32)
    z = tl.zeros([BLOCK_M], dtype=tl.float32)
    for s in range(SPLITS):
        part = (first + s) * BLOCK_M + r
        acc_s = tl.load(ACC + part[:, None] * HEAD_DIM_V + cols[None, :])
        z_s = tl.load(ZS + part)
        if ONLINE_MAX:
            # m_s <= m: the factors are at most 1; a split that ran no key block of the row (m_s = -inf, its acc
            # and z 0) weighs 0
            m_s = tl.load(MS + part)
            seen = m_s != float("-inf")
            x = tl.where(seen, m_s - m, 0.0)
            if EXP2:  # base-2 maxima (a1 = a2 = exp): fwd's rescale exp2(m_old - m_new)
                alpha1 = tl.math.exp2(x)
                alpha2 = alpha1
            else:
                alpha1 = A1(x)
                alpha2 = A2(x)
            acc += acc_s * tl.where(seen, alpha1, 0.0)[:, None]
            z += z_s * tl.where(seen, alpha2, 0.0)
        else:
            acc += acc_s
            z += z_s
    offs_d, d_ok = _head_columns(HEAD_DIM, D)
    offs_dv, dv_ok = _value_columns(offs_d, d_ok, HEAD_DIM, D, HEAD_DIM_V, DV)
    o = _finish_rows(acc, z, rows_ok, B)
    _store_rows_stats(O, Z, M, o, z, m, off_b, off_hk, g, i, off_h, rows_ok, offs_dv, dv_ok,
                      stride_ob, stride_oh, stride_om, stride_od, HQ, GROUP, N_Q, ONLINE_MAX, EXP2)


# ---------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------


def decode_forward(kernels: AttentionKernels, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   w: torch.Tensor | None = None, scale: float | None = None, context: tuple | None = None, *,
                   splits: int | None = None, block_n: int | None = None, tma: bool | None = None,
                   out_dtype: torch.dtype | None = None, num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES
                   ) -> tuple:
    """`kernels.forward(q, k, v, w, scale, context)` by split-K decoding: the same arguments and returns,
    (o, (z, m)) with z, m float32 [B, Hq, Nq] (m None without the running max), the same O, Z, M (to rounding).
    splits: the number of key splits (None: `decode_splits` from N_K and the SM count); the split length is rounded
    up to whole key blocks, so fewer may run. One split stores the rows itself (no combine launch). block_n: keys per
    block (a power of two, at least 16; None: `decode_block_n`). tma: K and V read by bulk copies where
    `kernels.tma_ok` allows (None: USE_TMA, off: measured no faster). out_dtype: o's (default q's; float32 where a sink
    merges into o after: kernel_sink.py). num_warps, num_stages: the split kernel's launch (bench/decode.py --sweep)."""
    batch, hq, hkv, n_q, n_k, head_dim = kernels.shapes(q, k, v, w)
    if n_q == 0 or batch * hq == 0:  # no rows: nothing to split
        o, stats = kernels.forward(q, k, v, w, scale, context)
        return (o.to(out_dtype) if out_dtype is not None else o), stats
    context = kernels._context(context)
    head_dim_v = v.shape[3]
    group = hq // hkv
    scale = head_dim**-0.5 if scale is None else float(scale)
    online_max = kernels.config.online_max
    o = kernels.new((batch, hq, n_q, head_dim_v), out_dtype or q.dtype, q.device)
    z = kernels.new((batch, hq, n_q), torch.float32, q.device)
    m = kernels.new((batch, hq, n_q), torch.float32, q.device) if online_max else None
    tile, tile_v = head_tile(head_dim), head_tile(head_dim_v)
    block_m = packed_rows(group, n_q)
    block_n = decode_block_n(max(tile, tile_v)) if block_n is None else int(block_n)
    blocks = max(1, triton.cdiv(n_k, block_n))  # (no keys: one split that runs no block, every row 0)
    if splits is None:
        splits = decode_splits(n_k, batch * hkv, block_n, sm_count(q.device))
    split_blocks = triton.cdiv(blocks, max(1, min(int(splits), blocks)))
    if kernels.causal:  # rows see keys [0, N_Q): the first split holds all of them, every row's key 0 included
        split_blocks = max(split_blocks, triton.cdiv(n_q, block_n))
    splits = triton.cdiv(blocks, split_blocks)
    final = splits == 1
    rows = batch * hkv * splits * block_m
    if final:  # unused pointer arguments
        acc_p, z_p, m_p = z, z, z
    else:
        acc_p = kernels.new((rows, tile_v), torch.float32, q.device)
        z_p = kernels.new((rows,), torch.float32, q.device)
        m_p = kernels.new((rows,), torch.float32, q.device) if online_max else z_p
    m_arg = m if m is not None else z
    w_arg, w_strides = weight_arg(w, q)
    use_tma = (USE_TMA if tma is None else tma) and kernels.tma_ok(k, v)
    k_arg, v_arg = k, v
    if use_tma:
        k_arg, v_arg = descriptor(k, True), descriptor(v, True)
        k_arg.block_shape = [1, 1, block_n, tile]
        v_arg.block_shape = [1, 1, block_n, tile_v]
    dims: dict[str, Any] = {"HEAD_DIM": tile, "D": head_dim, "HEAD_DIM_V": tile_v, "DV": head_dim_v}
    fast(decode_split_kernel)[(splits, batch * hkv)](
        q, k_arg, v_arg, w_arg, o, z, m_arg, acc_p, z_p, m_p,
        *q.stride(), *k.stride(), *v.stride(), *o.stride(), *w_strides,
        scale, hq, hkv, group, n_q, n_k, split_blocks * block_n, context,
        **dims, PRECISION=kernels.precision(q.dtype), NEG_SCALE=scale < 0, UNIT_SCALE=scale == 1.0,
        TMA=use_tma,
        **kernels.forward_spec, BLOCK_M=block_m, BLOCK_N=block_n, FINAL=final, num_warps=num_warps,
        num_stages=1 if _INTERPRET else num_stages,
    )
    if not final:
        spec = kernels.forward_spec
        fast(decode_combine_kernel)[(batch * hkv,)](
            o, z, m_arg, acc_p, z_p, m_p, *o.stride(), hq, hkv, group, n_q, splits,
            **dims, A1=spec["A1"], A2=spec["A2"], B=spec["B"], ONLINE_MAX=spec["ONLINE_MAX"], EXP2=spec["EXP2"],
            BLOCK_M=block_m, num_warps=4,
        )
    return o, (z, m)
