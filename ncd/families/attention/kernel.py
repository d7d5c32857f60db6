"""Normalized-contraction attention kernels: forward + FlashAttention-2 style backward, written once.

What a spec decides enters as `tl.constexpr` arguments: the scalar maps as `@triton.jit` device functions
(`A1`, `A2` and their derivatives `DA1`, `DA2`; `B` and `DB_OVER_B` = b'/b of the row normaliser; the stabiliser's
pre-map `PRE` and `DPRE`) and flags (`CAUSAL`, `HAS_WEIGHT`, `ONLINE_MAX`, `EXP2`, `SAME_A`, `HAS_PRE`, `FOLD`). Every
branch on them resolves at compile time, so each op compiles to the kernels its spec needs and nothing else.
The generated module of an op (render.py) holds the device functions and an `AttentionKernels`
(below) that launches these kernels with them.

Widths: q, k (and dQ, dK) are D wide, run at the tile HEAD_DIM (D rounded up to a power of two, at least 16); v, o,
dO, dV and the forward's accumulator DV wide at the tile HEAD_DIM_V (MLA-style attention: DV != D). Columns past a
true width load as zeros and are never stored (`_head_columns`, `_value_columns`).

The maths (``s_ij = scale * q_i . k_j``, optional causal mask, optional per-key weight ``w_j``)::

    z_i     = sum_j w_j a2(s_ij)
    o_i     = sum_j w_j a1(s_ij) v_j / b(z_i)
    dV_j    = sum_i w_j a1(s_ij) / b(z_i) dO_i
    delta_i = (dO_i . o_i) b'(z_i) / b(z_i)
    dS_ij   = w_j [a1'(s_ij) (dO_i . v_j) / b(z_i) - a2'(s_ij) delta_i]
    dQ      = scale dS K,  dK = scale dS^T Q

With ONLINE_MAX the kernels evaluate a1, a2 at ``s - m`` for a running row max ``m`` (valid when a1, a2 are
exponentials and b is homogeneous of the matching degree) and rescale the accumulators by ``a1(m_old - m_new)``
and ``a2(m_old - m_new)``. EXP2 (a1 = a2 = a1' = a2' = exp with the running max): the kernels evaluate exp2 with
log2(e) folded into the scale (one FFMA and one MUFU.EX2 per score) instead of the hooks. FOLD (a1 = a2 = a1' =
a2' = exp, exp2 or not): the backward takes l_i = m_i + log b(z_i) and delta_i b(z_i) per row (`_fold_rows`), so
that P = exp(s - l) and dS = P (dP - delta b) need no 1 / b(z) per score.

A row with z_i = 0 (a masked row: no visible key of nonzero weight; or every a2 term 0) has output 0 and passes
no gradient (FlexAttention's convention; docs/language.md).
"""
# ruff: noqa: E741, SIM108
# (kernels: tensors named O; constexpr branches written as statements, which Triton resolves at compile time)

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from ncd import settings as _settings
from ncd.families.attention.config import MEASURED_FORWARD_TILES, AttentionConfig, Tile
from ncd.launch import fast
from ncd.tuning import autotune

try:  # host-side TMA descriptors (Triton >= 3.3)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# The CPU interpreter multiplies bf16 dot operands wrongly (Triton 3.9); it gets fp32 copies instead,
# which is exact: bf16 -> fp32 is lossless and the accumulation is fp32 either way.
_UPCAST_DOT_OPERANDS = tl.constexpr(_INTERPRET)
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)

# Every kernel that evaluates the spec's maps takes them and the flags last, in this order, all constexpr:
MAPS = ("A1", "A2", "DA1", "DA2", "B", "DB_OVER_B", "PRE", "DPRE")
HOOKS = ("SCORE", "DSCORE", "SCORE_GRADS", "MASK", "KEY_RANGE", "QUERY_RANGE")  # modifiers.py; optional
FLAGS = ("CAUSAL", "HAS_WEIGHT", "ONLINE_MAX", "EXP2", "SAME_A", "HAS_PRE", "HAS_SCORE", "HAS_MASK",
         "HAS_SCORE_GRADS", "FOLD")


class Spec(NamedTuple):
    """The maps, hooks and flags (MAPS + HOOKS + FLAGS, in that order) as one constexpr for the device functions: a
    kernel bundles its arguments, `S: tl.constexpr = Spec(A1, ..., HAS_SCORE_GRADS)`, and a device function reads
    `S.A1(x)`, `S.CAUSAL`.
    Triton resolves the fields at compile time, as it does the arguments themselves: the same compiled code."""

    A1: Any
    A2: Any
    DA1: Any
    DA2: Any
    B: Any
    DB_OVER_B: Any
    PRE: Any
    DPRE: Any
    SCORE: Any
    DSCORE: Any
    SCORE_GRADS: Any
    MASK: Any
    KEY_RANGE: Any
    QUERY_RANGE: Any
    CAUSAL: Any
    HAS_WEIGHT: Any
    ONLINE_MAX: Any
    EXP2: Any
    SAME_A: Any
    HAS_PRE: Any
    HAS_SCORE: Any
    HAS_MASK: Any
    HAS_SCORE_GRADS: Any
    FOLD: Any


@triton.jit
def identity(x):
    """The pre-map of a spec without one (never called: HAS_PRE is False there), and the stand-in for the hooks
    of a spec without modifiers (never called: HAS_SCORE, HAS_MASK are False there)."""
    return x


@triton.jit
def _segments(lo, full_lo, full_hi, hi, N, BLOCK: tl.constexpr):
    """Block-aligned (start, a, b, end) from a mask's range over a block of rows (modifiers.py: it sees no
    position outside [lo, hi) and every one in [full_lo, full_hi)): blocks [start, a) and [b, end) run masked,
    [a, b) unmasked. The unmasked blocks lie inside [0, N) whole; an empty [lo, hi) runs nothing."""
    lo = tl.maximum(lo, 0)
    hi = tl.minimum(hi, N)
    start = lo // BLOCK * BLOCK
    end = tl.where(hi > lo, (hi + BLOCK - 1) // BLOCK * BLOCK, start)
    a = tl.minimum(tl.maximum((full_lo + BLOCK - 1) // BLOCK * BLOCK, start), end)
    b = tl.maximum(tl.minimum(tl.minimum(full_hi, N) // BLOCK * BLOCK, end), a)
    return start, a, b, end


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr):
    """acc + a @ b with fp32 accumulation (acc may be None)."""
    if _UPCAST_DOT_OPERANDS:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _in_head(cols, HEAD_DIM: tl.constexpr, D: tl.constexpr):
    """[1, len(cols)] mask of the head-dim columns `cols` that q, k, v have: the kernels' tile HEAD_DIM is D rounded
    up to a power of two (at least 16), and the columns past D load as zeros and are never stored. A constant
    when D == HEAD_DIM, so those kernels compile as if there were no mask."""
    if D == HEAD_DIM:
        return tl.full([1, cols.shape[0]], 1, tl.int1)
    else:
        return (cols < D)[None, :]


@triton.jit
def _head_columns(HEAD_DIM: tl.constexpr, D: tl.constexpr):
    """(offs_d, d_ok): the head-dim columns of a tile and the mask of those that exist (`_in_head`)."""
    offs_d = tl.arange(0, HEAD_DIM)
    return offs_d, _in_head(offs_d, HEAD_DIM, D)


@triton.jit
def _row_program(HQ, N_Q, BLOCK_M: tl.constexpr, HEAD_DIM_V: tl.constexpr, DV: tl.constexpr):
    """A row-wise kernel's program on grid (row blocks, batch x heads): (bh, off_b, off_h, rows, in_q, offs_d,
    d_ok), its rows and the mask of those that exist, and the value columns (`_head_columns`)."""
    bh = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d, d_ok = _head_columns(HEAD_DIM_V, DV)
    return bh, bh // HQ, bh % HQ, rows, rows < N_Q, offs_d, d_ok


@triton.jit
def _value_columns(offs_d, d_ok, HEAD_DIM: tl.constexpr, D: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                   DV: tl.constexpr):
    """(offs_dv, dv_ok): the columns of v, o, dO and dV (true width DV, tile HEAD_DIM_V), as `_head_columns`; where
    they are as wide as q and k, the same values as theirs (offs_d, d_ok), so that those kernels compile as before
    value widths of their own existed."""
    if HEAD_DIM_V == HEAD_DIM and DV == D:
        return offs_d, d_ok
    else:
        return _head_columns(HEAD_DIM_V, DV)


@triton.jit
def _head(X, off_b, off_h, stride_b, stride_h):
    """X advanced to batch off_b, head off_h (int64 offsets: a whole tensor may pass 2^31 elements)."""
    return X + off_b.to(tl.int64) * stride_b + off_h.to(tl.int64) * stride_h


@triton.jit
def _load_rows(base, offs, stride_n, stride_d, offs_d, rows_ok, d_ok):
    """The [len(offs), len(offs_d)] tile at rows offs, columns offs_d of the plane at base; 0 where a row is not
    rows_ok or a column not d_ok."""
    return tl.load(base + offs[:, None] * stride_n + offs_d[None, :] * stride_d, mask=rows_ok[:, None] & d_ok,
                   other=0.0)


@triton.jit
def _store_rows(base, x, offs, stride_n, stride_d, offs_d, rows_ok, d_ok):
    """Store the tile x, in base's dtype, at rows offs, columns offs_d of the plane at base (where rows_ok, d_ok)."""
    tl.store(base + offs[:, None] * stride_n + offs_d[None, :] * stride_d, x.to(base.dtype.element_ty),
             mask=rows_ok[:, None] & d_ok)


@triton.jit
def _query_block_program(HQ, GROUP, BLOCK_M: tl.constexpr, REVERSE: tl.constexpr, HEADS_FAST: tl.constexpr):
    """(bh, off_b, off_h, off_hk, start_m, offs_m) of a program of a grid over (query block, batch * query head),
    its axes swapped with HEADS_FAST; REVERSE (causal) runs the heaviest, last, query blocks first."""
    if HEADS_FAST:
        pid_blk, num_blk, bh = tl.program_id(1), tl.num_programs(1), tl.program_id(0)
    else:
        pid_blk, num_blk, bh = tl.program_id(0), tl.num_programs(0), tl.program_id(1)
    if REVERSE:
        pid_m = num_blk - 1 - pid_blk
    else:
        pid_m = pid_blk
    off_b = bh // HQ
    off_h = bh % HQ
    off_hk = off_h // GROUP
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    return bh, off_b, off_h, off_hk, start_m, offs_m


@triton.jit
def _key_block_program(HKV, BLOCK_N: tl.constexpr, HEADS_FAST: tl.constexpr):
    """(bhk, off_b, off_hk, pid_n, start_n, offs_n) of a program of a grid over (key block, batch * kv head)."""
    if HEADS_FAST:
        pid_n, bhk = tl.program_id(1), tl.program_id(0)
    else:
        pid_n, bhk = tl.program_id(0), tl.program_id(1)
    off_b = bhk // HKV
    off_hk = bhk % HKV
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    return bhk, off_b, off_hk, pid_n, start_n, offs_n


@triton.jit
def _query_head(Q, DO, off_b, off_hk, g, stride_qb, stride_qh, stride_dob, stride_doh, HQ, GROUP, N_Q,
                TMA: tl.constexpr):
    """(off_h, bh, q_base, do_base, stat_base) of the g-th query head of kv head off_hk: Q and dO at that head (the
    descriptors themselves when TMA) and the offset of its rows in the [B, Hq, Nq] statistics."""
    off_h = off_hk * GROUP + g
    if TMA:
        q_base, do_base = Q, DO
    else:
        q_base = _head(Q, off_b, off_h, stride_qb, stride_qh)
        do_base = _head(DO, off_b, off_h, stride_dob, stride_doh)
    bh = off_b * HQ + off_h
    stat_base = bh.to(tl.int64) * N_Q
    return off_h, bh, q_base, do_base, stat_base


@triton.jit
def _key_blocks(start_m, N_K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """(full_end, hi) for the query block at start_m: key blocks [0, full_end) need no mask, [full_end, hi) are
    masked (bounds; with CAUSAL also the diagonal: keys up to the block's last query)."""
    if CAUSAL:
        return tl.minimum((start_m + 1) // BLOCK_N * BLOCK_N, N_K // BLOCK_N * BLOCK_N), tl.minimum(start_m + BLOCK_M,
                                                                                                     N_K)
    else:
        return N_K // BLOCK_N * BLOCK_N, N_K


@triton.jit
def _query_blocks(start_n, N_Q, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """(lo, diag_end) for the key block at start_n: with CAUSAL, query blocks before lo see none of its keys, those
    in [lo, diag_end) straddle the diagonal (masked) and later ones see the whole block; without, (0, 0)."""
    if CAUSAL:
        lo = start_n // BLOCK_M * BLOCK_M
        diag_end = tl.minimum((start_n + BLOCK_N - 1 + BLOCK_M - 1) // BLOCK_M * BLOCK_M,
                              (N_Q + BLOCK_M - 1) // BLOCK_M * BLOCK_M)
    else:
        lo = 0
        diag_end = 0
    return lo, diag_end


@triton.jit
def _key_weight(w_base, offs_n, in_k, stride_wn, MASKED: tl.constexpr):
    """The per-key weights of a key block (fp32); MASKED blocks read zeros past N_K."""
    if MASKED:
        return tl.load(w_base + offs_n * stride_wn, mask=in_k, other=0.0)
    else:
        return tl.load(w_base + offs_n * stride_wn)


@triton.jit
def _load_kv(k_src, v_src, stride_kn, stride_kd, stride_vn, stride_vd, start_n, offs_n, in_k, offs_d, d_ok, offs_dv,
             dv_ok, off_b, off_hk, MASKED: tl.constexpr, TMA: tl.constexpr, BLOCK_N: tl.constexpr,
             HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr):
    """(k, v) of the key block at start_n ([BLOCK_N, HEAD_DIM] and [BLOCK_N, HEAD_DIM_V]). k_src, v_src: TMA
    descriptors of K, V (rows past N_K read as zeros) when TMA, else pointers at the head; MASKED blocks reach past
    N_K."""
    if TMA:
        k = k_src.load([off_b, off_hk, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        v = v_src.load([off_b, off_hk, start_n, 0]).reshape(BLOCK_N, HEAD_DIM_V)
    else:
        k_ptrs = k_src + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
        v_ptrs = v_src + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd
        if MASKED:
            k = tl.load(k_ptrs, mask=in_k[:, None] & d_ok, other=0.0)
            v = tl.load(v_ptrs, mask=in_k[:, None] & dv_ok, other=0.0)
        else:
            k = tl.load(k_ptrs, mask=d_ok, other=0.0)
            v = tl.load(v_ptrs, mask=dv_ok, other=0.0)
    return k, v


@triton.jit
def _load_key_block(K, V, W, off_b, off_hk, offs_n, offs_d, d_ok, offs_dv, dv_ok, in_k,
                    stride_kb, stride_kh, stride_kn, stride_kd, stride_vb, stride_vh, stride_vn, stride_vd,
                    stride_wb, stride_wn, HAS_WEIGHT: tl.constexpr):
    """(k, v, w) of one key block ([BLOCK_N, HEAD_DIM] and [BLOCK_N, HEAD_DIM_V] tiles; w: the per-key weights, or
    1.0 without)."""
    k_base = _head(K, off_b, off_hk, stride_kb, stride_kh)
    v_base = _head(V, off_b, off_hk, stride_vb, stride_vh)
    k = _load_rows(k_base, offs_n, stride_kn, stride_kd, offs_d, in_k, d_ok)
    v = _load_rows(v_base, offs_n, stride_vn, stride_vd, offs_dv, in_k, dv_ok)
    if HAS_WEIGHT:
        w = tl.load(W + off_b.to(tl.int64) * stride_wb + offs_n * stride_wn, mask=in_k, other=0.0)
    else:
        w = 1.0
    return k, v, w


@triton.jit
def _store_key_block(DK, DV_GRAD, dk, dv, off_b, off_hk, offs_n, offs_d, d_ok, offs_dv, dv_ok, in_k,
                     stride_dkb, stride_dkh, stride_dkn, stride_dkd, stride_dvb, stride_dvh, stride_dvn, stride_dvd):
    dk_base = _head(DK, off_b, off_hk, stride_dkb, stride_dkh)
    dv_base = _head(DV_GRAD, off_b, off_hk, stride_dvb, stride_dvh)
    _store_rows(dk_base, dk, offs_n, stride_dkn, stride_dkd, offs_d, in_k, d_ok)
    _store_rows(dv_base, dv, offs_n, stride_dvn, stride_dvd, offs_dv, in_k, dv_ok)


# ---------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------


@triton.jit
def _fwd_block(
    acc, z, m, q, k_src, v_src, w_base, stride_kn, stride_kd, stride_vn, stride_vd, stride_wn,
    start_n, offs_m, offs_d, d_ok, offs_dv, dv_ok, N_K, scale, qk_scale, off_b, off_hk, off_h, C,
    MASKED: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    PRECISION: tl.constexpr, NEG_SCALE: tl.constexpr, UNIT_SCALE: tl.constexpr, TMA: tl.constexpr, S: tl.constexpr,
):
    """Accumulate the key block at start_n into (acc, z, m); MASKED blocks apply the bounds (and causal, or the
    spec's) masks. qk_scale = scale * log2(e) (EXP2). With HAS_MASK a row may have seen no key yet (m = -inf):
    its running max counts as 0 there, so that no -inf - (-inf) forms."""
    start_n = tl.multiple_of(start_n, BLOCK_N)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    in_k = offs_n < N_K
    k, v = _load_kv(k_src, v_src, stride_kn, stride_kd, stride_vn, stride_vd, start_n, offs_n, in_k, offs_d, d_ok,
                    offs_dv, dv_ok, off_b, off_hk, MASKED, TMA, BLOCK_N, HEAD_DIM, HEAD_DIM_V)
    NATURAL: tl.constexpr = S.HAS_SCORE or S.HAS_PRE  # EXP2 after a modifier: qk_scale = log2(e), s natural
    NEG: tl.constexpr = NEG_SCALE and not NATURAL
    if S.EXP2:
        qk = _dot(q, tl.trans(k), None, PRECISION)  # scaled below, in base-2 units
        if NATURAL:  # the modifier and the pre-map take the natural score
            if not UNIT_SCALE:
                qk = qk * scale
            if S.HAS_SCORE:
                qk = S.SCORE(qk, offs_m[:, None], offs_n[None, :], off_b, off_h, C)
            if S.HAS_PRE:
                qk = S.PRE(qk)
    else:
        s = _dot(q, tl.trans(k), None, PRECISION)
        if not UNIT_SCALE:  # scale == 1 (e.g. spherical, where any positive scale cancels): skip the multiply
            s = s * scale
        if S.HAS_SCORE:
            s = S.SCORE(s, offs_m[:, None], offs_n[None, :], off_b, off_h, C)  # s' = the spec's modifier
        if S.HAS_PRE:
            s = S.PRE(s)  # t = h(s): the maps and the running max take t
    if MASKED:
        visible = in_k[None, :]
        if S.CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None])
        if S.HAS_MASK:
            visible = visible & S.MASK(offs_m[:, None], offs_n[None, :], off_b, off_h, C)
    if S.EXP2:
        # a1 = a2 = exp with a running row max m (kept in base-2 units here): one exp2 per score, one
        # per row for the rescale
        if MASKED:
            qk = tl.where(visible, qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(qk, 1))
            m_use = m_new
            if S.HAS_MASK:  # a row that has seen no key keeps m = -inf (not 0: its first scores may lie below -87,
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # where exp(s - 0) underflows); 0 stands in
            p = tl.math.exp2(qk - m_use[:, None])
        else:
            if NEG:
                m_new = tl.maximum(m, tl.min(qk, 1) * qk_scale)
            else:
                m_new = tl.maximum(m, tl.max(qk, 1) * qk_scale)
            m_use = m_new
            p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        # (FA3's lazy rescale -- skip this when no row max grew by more than 2^8 -- measured 5-12% slower here:
        # the block-uniform branch stops the loop's software pipelining; H100, 2026-11-21)
        alpha = tl.math.exp2(m - m_use)
        acc = acc * alpha[:, None]
        m = m_new
        if S.HAS_WEIGHT:
            p = p * _key_weight(w_base, offs_n, in_k, stride_wn, MASKED)[None, :]
        z = z * alpha + tl.sum(p, 1)
        acc = _dot(p.to(v.dtype), v, acc, PRECISION)
    else:
        if S.ONLINE_MAX:
            # running row max: evaluate the maps at s - m, rescale what was accumulated so far
            if MASKED:
                m_new = tl.maximum(m, tl.max(tl.where(visible, s, float("-inf")), 1))
            else:
                m_new = tl.maximum(m, tl.max(s, 1))
            m_use = m_new
            if S.HAS_MASK:  # as above: m stays -inf until the row sees a key, the maps take 0 in its place
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            acc = acc * S.A1(m - m_use)[:, None]
            z = z * S.A2(m - m_use)
            m = m_new
            x = s - m_use[:, None]
            if MASKED:  # the maps are C exp(c x), c > 0: 0 at -inf, where a masked score could overflow them
                x = tl.where(visible, x, float("-inf"))
        else:
            x = s
        p1 = S.A1(x)
        if S.HAS_WEIGHT:
            w = _key_weight(w_base, offs_n, in_k, stride_wn, MASKED)
            p1 = p1 * w[None, :]
        if MASKED and not S.ONLINE_MAX:
            p1 = tl.where(visible, p1, 0.0)
        if S.SAME_A:
            p2 = p1
        else:
            p2 = S.A2(x)
            if S.HAS_WEIGHT:
                p2 = p2 * w[None, :]
            if MASKED and not S.ONLINE_MAX:
                p2 = tl.where(visible, p2, 0.0)
        z += tl.sum(p2, 1)
        acc = _dot(p1.to(v.dtype), v, acc, PRECISION)
    return acc, z, m


@triton.jit
def _fwd_inner(
    acc, z, m, q, k_src, v_src, w_base, stride_kn, stride_kd, stride_vn, stride_vd, stride_wn,
    offs_m, lo, full_end, hi, N_K, scale, off_b, off_hk, off_h, C,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, D: tl.constexpr, HEAD_DIM_V: tl.constexpr, DV: tl.constexpr,
    PRECISION: tl.constexpr, NEG_SCALE: tl.constexpr, UNIT_SCALE: tl.constexpr, TMA: tl.constexpr, S: tl.constexpr,
):
    """Accumulate key blocks [lo, full_end) (no mask) and [full_end, hi) (masked) into (acc, z, m).
    k_src, v_src: TMA descriptors of K, V when TMA, else pointers at the head."""
    offs_d, d_ok = _head_columns(HEAD_DIM, D)
    offs_dv, dv_ok = _value_columns(offs_d, d_ok, HEAD_DIM, D, HEAD_DIM_V, DV)
    # EXP2: s * log2(e) - m2 = (s - m) * log2(e), exp(x) = exp2(x log2 e); after a score modifier or a pre-map
    # (their s natural), log2(e) alone
    if S.HAS_SCORE or S.HAS_PRE:
        qk_scale = LOG2E
    else:
        qk_scale = scale * LOG2E
    for start_n in range(lo, full_end, BLOCK_N):
        acc, z, m = _fwd_block(acc, z, m, q, k_src, v_src, w_base, stride_kn, stride_kd, stride_vn, stride_vd,
                               stride_wn, start_n, offs_m, offs_d, d_ok, offs_dv, dv_ok, N_K, scale, qk_scale, off_b,
                               off_hk, off_h, C, False,
                               BLOCK_N, HEAD_DIM, HEAD_DIM_V, PRECISION, NEG_SCALE, UNIT_SCALE, TMA, S)
    for start_n in range(full_end, hi, BLOCK_N):
        acc, z, m = _fwd_block(acc, z, m, q, k_src, v_src, w_base, stride_kn, stride_kd, stride_vn, stride_vd,
                               stride_wn, start_n, offs_m, offs_d, d_ok, offs_dv, dv_ok, N_K, scale, qk_scale, off_b,
                               off_hk, off_h, C, True,
                               BLOCK_N, HEAD_DIM, HEAD_DIM_V, PRECISION, NEG_SCALE, UNIT_SCALE, TMA, S)
    return acc, z, m


@triton.jit
def sink_place(T, off_b, off_h, rows, in_q, stride_tb, stride_th, stride_tm, u_const, SINK_MAP: tl.constexpr,
               HAS_T: tl.constexpr):
    """(u, sigma) per row (fp32): a sink's place u (sinks.py: in the maps' domain with the running max, else the
    value added to z) and its logit sigma (u_const and 0 for a constant sink)."""
    if HAS_T:
        sigma = tl.load(T + off_b.to(tl.int64) * stride_tb + off_h.to(tl.int64) * stride_th + rows * stride_tm,
                        mask=in_q, other=0.0).to(tl.float32)
        u = SINK_MAP(sigma)
    else:
        sigma = tl.zeros([rows.shape[0]], tl.float32)
        u = sigma + u_const
    return u, sigma


@triton.jit
def fwd_kernel(
    Q, K, V, W, O, Z, M,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_wb, stride_wn,
    scale, HQ, GROUP, N_Q, N_K, Q_BUCKET, K_BUCKET, WORK, C, G,
    T, stride_tb, stride_th, stride_tm, sink_u,
    HEAD_DIM: tl.constexpr, D: tl.constexpr, HEAD_DIM_V: tl.constexpr, DV: tl.constexpr, PRECISION: tl.constexpr,
    NEG_SCALE: tl.constexpr, UNIT_SCALE: tl.constexpr, TMA: tl.constexpr, SINK: tl.constexpr, SINK_MAP: tl.constexpr,
    A1: tl.constexpr, A2: tl.constexpr, DA1: tl.constexpr, DA2: tl.constexpr, B: tl.constexpr,
    DB_OVER_B: tl.constexpr, PRE: tl.constexpr, DPRE: tl.constexpr,
    SCORE: tl.constexpr, DSCORE: tl.constexpr, SCORE_GRADS: tl.constexpr, MASK: tl.constexpr,
    KEY_RANGE: tl.constexpr, QUERY_RANGE: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, ONLINE_MAX: tl.constexpr, EXP2: tl.constexpr,
    SAME_A: tl.constexpr, HAS_PRE: tl.constexpr, HAS_SCORE: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_SCORE_GRADS: tl.constexpr, FOLD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEADS_FAST: tl.constexpr,
):
    """One program per (query block, batch * query head); loops over key blocks. Q, K, V, O are TMA
    descriptors of the [B, H, N, D] tensors (V, O: [B, H, N, DV]) when TMA, else pointers. SINK (1: the constant
    place sink_u, 2: logits T [B, H, N_Q] by strides, u = SINK_MAP(logit)): the stream starts from the sink's state
    (kernel_sink.py: acc 0, z a2(0), m u; plain sums: z u), so o comes out with the sink merged."""
    S: tl.constexpr = Spec(A1, A2, DA1, DA2, B, DB_OVER_B, PRE, DPRE, SCORE, DSCORE, SCORE_GRADS, MASK,
                           KEY_RANGE, QUERY_RANGE, CAUSAL, HAS_WEIGHT, ONLINE_MAX, EXP2, SAME_A, HAS_PRE,
                           HAS_SCORE, HAS_MASK, HAS_SCORE_GRADS, FOLD)
    bh, off_b, off_h, off_hk, start_m, offs_m = _query_block_program(HQ, GROUP, BLOCK_M, CAUSAL, HEADS_FAST)
    offs_d, d_ok = _head_columns(HEAD_DIM, D)
    offs_dv, dv_ok = _value_columns(offs_d, d_ok, HEAD_DIM, D, HEAD_DIM_V, DV)
    in_q = offs_m < N_Q

    w_base = W + off_b.to(tl.int64) * stride_wb
    if TMA:
        k_src, v_src = K, V
        q = Q.load([off_b, off_h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
    else:
        q_base = _head(Q, off_b, off_h, stride_qb, stride_qh)
        k_src = _head(K, off_b, off_hk, stride_kb, stride_kh)
        v_src = _head(V, off_b, off_hk, stride_vb, stride_vh)
        q = _load_rows(q_base, offs_m, stride_qm, stride_qd, offs_d, in_q, d_ok)

    acc = tl.zeros([BLOCK_M, HEAD_DIM_V], dtype=tl.float32)
    z = tl.zeros([BLOCK_M], dtype=tl.float32)
    if ONLINE_MAX:
        m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    else:
        m = tl.zeros([BLOCK_M], dtype=tl.float32)  # no running max: the maps are evaluated at s itself
    if SINK:
        u, _ = sink_place(T, off_b, off_h, offs_m, in_q, stride_tb, stride_th, stride_tm, sink_u, SINK_MAP, SINK == 2)
        if EXP2:
            m = u * LOG2E
            z = z + 1.0
        elif ONLINE_MAX:
            m = u
            z = A2(z)
        else:
            z = u

    if HAS_MASK:  # the spec's mask: skip the key blocks it hides, run those it shows whole without it
        lo, full_lo, full_hi, hi = KEY_RANGE(offs_m, off_b, off_h, C)
        start, a, b, end = _segments(lo, full_lo, full_hi, hi, N_K, BLOCK_N)
        acc, z, m = _fwd_inner(acc, z, m, q, k_src, v_src, w_base, stride_kn, stride_kd, stride_vn, stride_vd,
                               stride_wn, offs_m, start, start, a, N_K, scale, off_b, off_hk, off_h, C, BLOCK_N,
                               HEAD_DIM, D, HEAD_DIM_V, DV, PRECISION, NEG_SCALE, UNIT_SCALE, TMA, S)
        acc, z, m = _fwd_inner(acc, z, m, q, k_src, v_src, w_base, stride_kn, stride_kd, stride_vn, stride_vd,
                               stride_wn, offs_m, a, b, end, N_K, scale, off_b, off_hk, off_h, C, BLOCK_N, HEAD_DIM,
                               D, HEAD_DIM_V, DV, PRECISION, NEG_SCALE, UNIT_SCALE, TMA, S)
        m = tl.where(m == float("-inf"), 0.0, m)  # a row that sees no key: its saved max stays finite
    else:
        full_end, hi = _key_blocks(start_m, N_K, BLOCK_M, BLOCK_N, CAUSAL)
        acc, z, m = _fwd_inner(acc, z, m, q, k_src, v_src, w_base, stride_kn, stride_kd, stride_vn, stride_vd,
                               stride_wn, offs_m, 0, full_end, hi, N_K, scale, off_b, off_hk, off_h, C, BLOCK_N,
                               HEAD_DIM, D, HEAD_DIM_V, DV, PRECISION, NEG_SCALE, UNIT_SCALE, TMA, S)

    o = _finish_rows(acc, z, in_q, B)
    if TMA:  # the bulk store clips rows past N_Q
        O.store([off_b, off_h, start_m, 0], o.to(O.dtype).reshape(1, 1, BLOCK_M, HEAD_DIM_V))
    else:
        _store_rows(_head(O, off_b, off_h, stride_ob, stride_oh), o, offs_m, stride_om, stride_od, offs_dv, in_q,
                    dv_ok)
    _store_stats(Z, M, bh.to(tl.int64) * N_Q + offs_m, z, m, in_q, EXP2, ONLINE_MAX)


@triton.jit
def _store_stats(Z, M, offs, z, m, ok, EXP2: tl.constexpr, ONLINE_MAX: tl.constexpr):
    """A forward's saved row statistics: z, and m in natural units (the kernels keep it in base 2 with EXP2)."""
    tl.store(Z + offs, z, mask=ok)
    if EXP2:
        tl.store(M + offs, m * LN2, mask=ok)
    elif ONLINE_MAX:
        tl.store(M + offs, m, mask=ok)


# ---------------------------------------------------------------------------------------------
# Backward: delta_i = (dO_i . o_i) * b'(z_i) / b(z_i). The fused backward computes it here; the
# deterministic one in its dQ kernel, which runs first.
# ---------------------------------------------------------------------------------------------


@triton.jit
def _finish_rows(acc, z, in_q, B: tl.constexpr):
    """o = acc / b(z) for a block of rows (streamed and chunked forwards). A row with z = 0 (no visible key of
    nonzero weight: a masked row) is 0, FlexAttention's convention (docs/language.md). Such rows and rows past N_Q
    take b(1), as the backward's loads of z do: b(0) may be a 0 / 0 or a log(0), which warn on the interpreter."""
    return tl.where((z == 0)[:, None], 0.0, acc / B(tl.where(in_q & (z != 0), z, 1.0))[:, None])


@triton.jit
def _inv_b(z, B: tl.constexpr):
    """1 / b(z) for a block of rows; 0 for a masked row (z = 0), which so passes no gradient."""
    return tl.where(z == 0, 0.0, 1.0 / B(tl.where(z == 0, 1.0, z)))


@triton.jit
def _row_delta(o, do, z, DB_OVER_B: tl.constexpr):
    """delta_i = (dO_i . o_i) * b'(z_i) / b(z_i) for a block of rows, in fp32; 0 for a masked row (z = 0)."""
    dot = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    return tl.where(z == 0, 0.0, dot * DB_OVER_B(tl.where(z == 0, 1.0, z)))


@triton.jit
def _fold_rows(m, inv_b, delta, EXP2: tl.constexpr):
    """FOLD's backward statistics of a block of rows (a1 = a2 = a1' = a2' = exp): l = m + log b(z) (base 2 with
    EXP2, m the row max in the kernel's units) and delta * b(z), so that P = exp(s - l) and dS = P (dP - delta b(z))
    take no per-element 1 / b(z). A masked row (1 / b = 0) gets l = +inf, hence P = 0. Computed once per row by
    the kernel that computes delta: folded inside the dK/dV loop the same arithmetic measured 30-40% slower,
    precomputed 20-31% faster (H100, bench/log/2026-11-26-issue32-s5.md)."""
    live = inv_b != 0
    safe_inv_b = tl.where(live, inv_b, 1.0)  # no inf - inf in a masked row (m = -inf), no log of 0
    if EXP2:
        log_b = -tl.math.log2(safe_inv_b)
    else:
        log_b = -tl.log(safe_inv_b)
    return tl.where(live, m + log_b, float("inf")), tl.where(live, delta / safe_inv_b, 0.0)


@triton.jit
def bwd_delta_kernel(
    O, DO, Z, M, L2, DELTA, DQ_ACC,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_dob, stride_doh, stride_dom, stride_dod,
    HQ, N_Q,
    HEAD_DIM: tl.constexpr, D: tl.constexpr, HEAD_DIM_V: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr,
    ZERO_DQ: tl.constexpr, B: tl.constexpr, DB_OVER_B: tl.constexpr, DELTA_IN: tl.constexpr, FOLD: tl.constexpr,
    EXP2: tl.constexpr,
):
    """delta for a block of rows (o, dO: width DV), plus (DELTA_IN) what DELTA holds already (the row statistic's
    own gradient, runtime.py), and (ZERO_DQ) those rows of the fp32 dQ accumulator (width D, rows of HEAD_DIM)
    zeroed. FOLD (the dK/dV kernels' FOLD): DELTA gets delta * b(z) and L2 the rows' l (`_fold_rows`) from M."""
    bh, off_b, off_h, _, _, offs_m = _query_block_program(HQ, 1, BLOCK_M, False, False)
    offs_d, d_ok = _head_columns(HEAD_DIM, D)
    offs_dv, dv_ok = _value_columns(offs_d, d_ok, HEAD_DIM, D, HEAD_DIM_V, DV)
    in_q = offs_m < N_Q
    o_base = _head(O, off_b, off_h, stride_ob, stride_oh)
    do_base = _head(DO, off_b, off_h, stride_dob, stride_doh)
    o = _load_rows(o_base, offs_m, stride_om, stride_od, offs_dv, in_q, dv_ok)
    do = _load_rows(do_base, offs_m, stride_dom, stride_dod, offs_dv, in_q, dv_ok)
    stat_offs = bh.to(tl.int64) * N_Q + offs_m
    z = tl.load(Z + stat_offs, mask=in_q, other=1.0)
    delta = _row_delta(o, do, z, DB_OVER_B)
    if DELTA_IN:
        delta += tl.load(DELTA + stat_offs, mask=in_q, other=0.0)
    if FOLD:
        m = tl.load(M + stat_offs, mask=in_q, other=0.0)
        if EXP2:
            m = m * LOG2E
        l, delta = _fold_rows(m, _inv_b(z, B), delta, EXP2)
        tl.store(L2 + stat_offs, l, mask=in_q)
    tl.store(DELTA + stat_offs, delta, mask=in_q)
    if ZERO_DQ:
        tl.store(DQ_ACC + stat_offs[:, None] * HEAD_DIM + offs_d[None, :],
                 tl.zeros([BLOCK_M, HEAD_DIM], tl.float32), mask=in_q[:, None] & d_ok)


@triton.jit
def _across(rows, KEYS_ROWS: tl.constexpr):
    """A per-query vector broadcast across a score tile: its columns are the queries when KEYS_ROWS, else its rows."""
    if KEYS_ROWS:
        return rows[None, :]
    else:
        return rows[:, None]


@triton.jit
def _score_grads(a, b, da, db, inv_b, delta, m, m_base, offs_m, in_q, scale, i, j, off_b, off_h, C, visible,
                 PRECISION: tl.constexpr, KEYS_ROWS: tl.constexpr, SELECT: tl.constexpr, S: tl.constexpr):
    """(P, dS, s, ds'/ds) of one score tile, before weights and masks: scores a b^T, dP = da db^T. KEYS_ROWS (the
    dK/dV side): a, b, da, db = k, q, v, dO, the tiles are transposed (rows are keys), P is returned and the row max
    is loaded from m_base; else q, k, dO, v with the row max m given and P not needed. With FOLD the row statistics
    are the folded ones (m: l, delta: delta * b(z); `_fold_rows`). With a score modifier (HAS_SCORE; i, j: the
    tile's broadcastable query and key positions) dS is the gradient of the modified score s', and s (the scaled
    score) and ds'/ds come back for the modifier's own gradients; without one they are 0 and 1. SELECT: the tile's
    `visible` entries only; with the running max (EXP2 too) it applies to the exponent (P = 0 and dS = 0 elsewhere,
    and no overflow in a masked score or a padding key's: the caller's `where` after it is then redundant); maps
    without one are bounded or polynomial and leave it to the caller."""
    s0 = 0.0
    dmod = 1.0
    if S.EXP2:  # a1 = a2 = a1' = a2' = exp (FOLD too): m and delta are folded (`_fold_rows`), inv_b unused
        qk = _dot(a, tl.trans(b), None, PRECISION)
        if KEYS_ROWS:  # rows past N_Q: l = +inf, so P = 0
            m = tl.load(m_base + offs_m, mask=in_q, other=float("inf"))
        x = qk * (scale * LOG2E) - _across(m, KEYS_ROWS)
        if SELECT:
            x = tl.where(visible, x, float("-inf"))
        p1 = tl.math.exp2(x)  # e / b(z)
        dp = _dot(da, tl.trans(db), None, PRECISION)  # dO_i . v_j
        ds = p1 * (dp - _across(delta, KEYS_ROWS))
    else:
        s = _dot(a, tl.trans(b), None, PRECISION) * scale
        if S.HAS_SCORE:
            s0 = s
            dmod = S.DSCORE(s, i, j, off_b, off_h, C)
            # rows past N_Q and keys past N_K score 0, as without a modifier: there the row statistics are
            # placeholders (m = 0), and a modified score (ALiBi's slope * (j - i), at a negative slope) overflowed
            # a1 into inf and NaN lanes that only the masked last block's `where` discarded
            s = tl.where((i < C[0]) & (j < C[1]), S.SCORE(s, i, j, off_b, off_h, C), 0.0)
        if S.HAS_PRE:
            dpre = S.DPRE(s)  # chain rule through t = h(s)
            s = S.PRE(s)
        if S.ONLINE_MAX:
            if KEYS_ROWS:  # FOLD: rows past N_Q take l = +inf, so P = 0
                m = tl.load(m_base + offs_m, mask=in_q, other=float("inf") if S.FOLD else 0.0)
            x = s - _across(m, KEYS_ROWS)
            if SELECT:  # the maps are C exp(c x), c > 0 (streaming.py): 0 at -inf, and so are their derivatives
                x = tl.where(visible, x, float("-inf"))
        else:
            x = s
        dp = _dot(da, tl.trans(db), None, PRECISION)  # dO_i . v_j
        if S.FOLD:  # a1 = a2 = a1' = a2' = exp after a pre-map or a score modifier: P = exp(t - l)
            p1 = S.A1(x)
            ds = p1 * (dp - _across(delta, KEYS_ROWS))
        else:
            if KEYS_ROWS:
                p1 = S.A1(x) * _across(inv_b, KEYS_ROWS)
            else:
                p1 = 0.0
            ds = S.DA1(x) * dp * _across(inv_b, KEYS_ROWS) - S.DA2(x) * _across(delta, KEYS_ROWS)
        if S.HAS_PRE:
            ds = ds * dpre
    return p1, ds, s0, dmod


# ---------------------------------------------------------------------------------------------
# Backward: dK, dV (one program per key block, loops over the query heads of its kv head and
# over query blocks; S is recomputed block by block, transposed: rows are keys)
# ---------------------------------------------------------------------------------------------


@triton.jit
def _dkdv_block(
    dk, dv, k, v, w, in_k, q_base, do_base, z_base, m_base, delta_base,
    stride_qm, stride_qd, stride_dom, stride_dod,
    start_m, offs_n, offs_d, d_ok, offs_dv, dv_ok, N_Q, scale, off_b, off_h, C, G,
    MASKED: tl.constexpr, KEY_MASK: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr, S: tl.constexpr,
):
    """Add the query block at start_m's share to dK, dV of the key block; returns (dk, dv, dS^T in q's dtype, offs_m,
    in_q). MASKED: the block straddles the causal diagonal or the spec's mask; KEY_MASK: the key block crosses N_K,
    whose keys past it get P = dS = 0 (their zero K rows must not carry a non-finite dS into a dQ). q_base, do_base:
    descriptors of Q, dO when TMA, else pointers."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    in_q = offs_m < N_Q
    # rows past N_Q load as zeros (and z = 1), so they contribute nothing
    if TMA:
        q = q_base.load([off_b, off_h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
        do = do_base.load([off_b, off_h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM_V)
    else:
        q = _load_rows(q_base, offs_m, stride_qm, stride_qd, offs_d, in_q, d_ok)
        do = _load_rows(do_base, offs_m, stride_dom, stride_dod, offs_dv, in_q, dv_ok)
    inv_b = _inv_b(tl.load(z_base + offs_m, mask=in_q, other=1.0), S.B)
    delta = tl.load(delta_base + offs_m, mask=in_q, other=0.0)
    # bounds too: a row past N_Q may hold a modified score that overflows
    visible = in_k[:, None] & in_q[None, :]
    if MASKED:
        if S.CAUSAL:
            visible = visible & (offs_m[None, :] >= offs_n[:, None])
        if S.HAS_MASK:
            visible = visible & S.MASK(offs_m[None, :], offs_n[:, None], off_b, off_h, C)
    SELECT: tl.constexpr = MASKED or KEY_MASK
    p1_t, ds_t, s_t, dmod_t = _score_grads(k, q, v, do, inv_b, delta, 0.0, m_base, offs_m, in_q, scale,
                                           offs_m[None, :], offs_n[:, None], off_b, off_h, C, visible, PRECISION,
                                           True, SELECT, S)
    if S.HAS_WEIGHT:
        p1_t = p1_t * w[:, None]
        ds_t = ds_t * w[:, None]
    if SELECT and not S.ONLINE_MAX:
        p1_t = tl.where(visible, p1_t, 0.0)
        ds_t = tl.where(visible, ds_t, 0.0)
    if S.HAS_SCORE:
        if S.HAS_SCORE_GRADS:  # each (query, key) pair passes here once: the modifier tensors' gradients
            S.SCORE_GRADS(ds_t, s_t, offs_m[None, :], offs_n[:, None], off_b, off_h, C, G)
        ds_t = ds_t * dmod_t
    dv = _dot(p1_t.to(do.dtype), do, dv, PRECISION)
    ds_t = ds_t.to(q.dtype)
    dk = _dot(ds_t, q, dk, PRECISION)
    return dk, dv, ds_t, offs_m, in_q


@triton.jit
def _store_ds(ds_dst, ds_t, bh, start_n, start_m, offs_n, offs_m, in_q, stride_dsn, N_K, BLOCK_N: tl.constexpr,
              BLOCK_M: tl.constexpr, DS_BULK: tl.constexpr):
    """Store a dS^T tile for the dQ-from-dS kernel: ds_dst is a descriptor of dS [B * Hq, Nk, Nq] when DS_BULK (the
    bulk store clips keys past N_K and queries past N_Q), else a pointer at head bh's [Nk, Nq] plane."""
    if DS_BULK:
        ds_dst.store([bh, start_n, start_m], ds_t.reshape(1, BLOCK_N, BLOCK_M))
    else:
        tl.store(ds_dst + offs_n[:, None] * stride_dsn + offs_m[None, :], ds_t,
                 mask=(offs_n[:, None] < N_K) & in_q[None, :])


@triton.jit
def _bwd_dkdv_inner(
    dk, dv, k, v, w, in_k, q_base, do_base, z_base, m_base, delta_base,
    stride_qm, stride_qd, stride_dom, stride_dod,
    start_n, lo, diag_end, hi, N_Q, N_K, scale, off_b, off_h, ds_dst, bh, stride_dsn, C, G,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, D: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    DV: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr, STORE_DS: tl.constexpr, DS_BULK: tl.constexpr,
    S: tl.constexpr,
):
    """dK, dV of the key block at start_n over the query blocks [lo, diag_end) (causal, or the spec's mask: masked)
    and [diag_end, hi) of one query head. STORE_DS: each dS^T tile (masked entries 0) also goes to ds_dst
    (`_store_ds`)."""
    offs_d, d_ok = _head_columns(HEAD_DIM, D)
    offs_dv, dv_ok = _value_columns(offs_d, d_ok, HEAD_DIM, D, HEAD_DIM_V, DV)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if S.CAUSAL or S.HAS_MASK:
        for start_m in range(lo, diag_end, BLOCK_M):
            dk, dv, ds_t, offs_m, in_q = _dkdv_block(
                dk, dv, k, v, w, in_k, q_base, do_base, z_base, m_base, delta_base, stride_qm, stride_qd,
                stride_dom, stride_dod, start_m, offs_n, offs_d, d_ok, offs_dv, dv_ok, N_Q, scale, off_b, off_h, C, G,
                True, False, BLOCK_M, HEAD_DIM, HEAD_DIM_V, PRECISION, TMA, S)
            if STORE_DS:
                _store_ds(ds_dst, ds_t, bh, start_n, start_m, offs_n, offs_m, in_q, stride_dsn, N_K, BLOCK_N, BLOCK_M,
                          DS_BULK)
    for start_m in range(diag_end, hi, BLOCK_M):
        dk, dv, ds_t, offs_m, in_q = _dkdv_block(
            dk, dv, k, v, w, in_k, q_base, do_base, z_base, m_base, delta_base, stride_qm, stride_qd,
            stride_dom, stride_dod, start_m, offs_n, offs_d, d_ok, offs_dv, dv_ok, N_Q, scale, off_b, off_h, C, G,
            False, False, BLOCK_M, HEAD_DIM, HEAD_DIM_V, PRECISION, TMA, S)
        if STORE_DS:
            _store_ds(ds_dst, ds_t, bh, start_n, start_m, offs_n, offs_m, in_q, stride_dsn, N_K, BLOCK_N, BLOCK_M,
                      DS_BULK)
    return dk, dv


@triton.jit
def bwd_dkdv_kernel(
    Q, K, V, W, DO, Z, M, DELTA, DK, DV_GRAD, DS,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    stride_wb, stride_wn, stride_dsn,
    scale, HQ, HKV, GROUP, N_Q, N_K, Q_BUCKET, K_BUCKET, WORK, C, G,
    HEAD_DIM: tl.constexpr, D: tl.constexpr, HEAD_DIM_V: tl.constexpr, DV: tl.constexpr, PRECISION: tl.constexpr,
    TMA: tl.constexpr, STORE_DS: tl.constexpr, DS_BULK: tl.constexpr,
    A1: tl.constexpr, A2: tl.constexpr, DA1: tl.constexpr, DA2: tl.constexpr, B: tl.constexpr,
    DB_OVER_B: tl.constexpr, PRE: tl.constexpr, DPRE: tl.constexpr,
    SCORE: tl.constexpr, DSCORE: tl.constexpr, SCORE_GRADS: tl.constexpr, MASK: tl.constexpr,
    KEY_RANGE: tl.constexpr, QUERY_RANGE: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, ONLINE_MAX: tl.constexpr, EXP2: tl.constexpr,
    SAME_A: tl.constexpr, HAS_PRE: tl.constexpr, HAS_SCORE: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_SCORE_GRADS: tl.constexpr, FOLD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEADS_FAST: tl.constexpr,
):
    """STORE_DS: also stores every dS^T tile into DS ([B * Hq, Nk, Nq], row stride stride_dsn; a descriptor when
    DS_BULK), for the dQ-from-dS kernel. With FOLD, M and DELTA hold the folded statistics (`_fold_rows`)."""
    S: tl.constexpr = Spec(A1, A2, DA1, DA2, B, DB_OVER_B, PRE, DPRE, SCORE, DSCORE, SCORE_GRADS, MASK,
                           KEY_RANGE, QUERY_RANGE, CAUSAL, HAS_WEIGHT, ONLINE_MAX, EXP2, SAME_A, HAS_PRE,
                           HAS_SCORE, HAS_MASK, HAS_SCORE_GRADS, FOLD)
    _, off_b, off_hk, _, start_n, offs_n = _key_block_program(HKV, BLOCK_N, HEADS_FAST)
    offs_d, d_ok = _head_columns(HEAD_DIM, D)
    offs_dv, dv_ok = _value_columns(offs_d, d_ok, HEAD_DIM, D, HEAD_DIM_V, DV)
    in_k = offs_n < N_K
    k, v, w = _load_key_block(K, V, W, off_b, off_hk, offs_n, offs_d, d_ok, offs_dv, dv_ok, in_k, stride_kb,
                              stride_kh, stride_kn, stride_kd, stride_vb, stride_vh, stride_vn, stride_vd, stride_wb,
                              stride_wn, HAS_WEIGHT)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_V], dtype=tl.float32)
    lo, diag_end = _query_blocks(start_n, N_Q, BLOCK_M, BLOCK_N, CAUSAL)
    # no key mask for the block that crosses N_K (its zero K rows may overflow exp2(-l2) in a row whose every score
    # is below -88, lanes never stored): a second compiled variant for it doubled the kernel's shared memory and made
    # dK/dV 15-50% slower (H100, bench/log/2026-11-26-issue32-s5.md)
    for g in range(GROUP):
        off_h, bh, q_base, do_base, stat_base = _query_head(Q, DO, off_b, off_hk, g, stride_qb, stride_qh, stride_dob,
                                                            stride_doh, HQ, GROUP, N_Q, TMA)
        if DS_BULK:
            ds_dst = DS
        else:
            ds_dst = DS + bh.to(tl.int64) * N_K * stride_dsn
        if HAS_MASK:  # the query blocks that see some key of this block, and those that see all of them
            q_lo, q_full_lo, q_full_hi, q_hi = QUERY_RANGE(offs_n, off_b, off_h, C)
            start, a, b, end = _segments(q_lo, q_full_lo, q_full_hi, q_hi, N_Q, BLOCK_M)
            dk, dv = _bwd_dkdv_inner(
                dk, dv, k, v, w, in_k, q_base, do_base, Z + stat_base, M + stat_base, DELTA + stat_base,
                stride_qm, stride_qd, stride_dom, stride_dod, start_n, start, a, b, N_Q, N_K, scale, off_b, off_h,
                ds_dst, bh, stride_dsn, C, G, BLOCK_M, BLOCK_N, HEAD_DIM, D, HEAD_DIM_V, DV, PRECISION, TMA, STORE_DS,
                DS_BULK, S,
            )
            dk, dv = _bwd_dkdv_inner(
                dk, dv, k, v, w, in_k, q_base, do_base, Z + stat_base, M + stat_base, DELTA + stat_base,
                stride_qm, stride_qd, stride_dom, stride_dod, start_n, b, end, end, N_Q, N_K, scale, off_b, off_h,
                ds_dst, bh, stride_dsn, C, G, BLOCK_M, BLOCK_N, HEAD_DIM, D, HEAD_DIM_V, DV, PRECISION, TMA, STORE_DS,
                DS_BULK, S,
            )
        else:
            dk, dv = _bwd_dkdv_inner(
                dk, dv, k, v, w, in_k, q_base, do_base, Z + stat_base, M + stat_base, DELTA + stat_base,
                stride_qm, stride_qd, stride_dom, stride_dod, start_n, lo, diag_end, N_Q, N_Q, N_K, scale, off_b,
                off_h, ds_dst, bh, stride_dsn, C, G, BLOCK_M, BLOCK_N, HEAD_DIM, D, HEAD_DIM_V, DV, PRECISION, TMA,
                STORE_DS, DS_BULK, S,
            )
    dk = dk * scale
    _store_key_block(DK, DV_GRAD, dk, dv, off_b, off_hk, offs_n, offs_d, d_ok, offs_dv, dv_ok, in_k, stride_dkb,
                     stride_dkh, stride_dkn, stride_dkd, stride_dvb, stride_dvh, stride_dvn, stride_dvd)


# ---------------------------------------------------------------------------------------------
# Backward: dQ (one program per query block, loops over key blocks)
# ---------------------------------------------------------------------------------------------


@triton.jit
def _dq_block(
    dq, q, do, m, inv_b, delta, k_base, v_base, w_base, stride_kn, stride_kd, stride_vn, stride_vd, stride_wn,
    start_n, offs_m, offs_d, d_ok, offs_dv, dv_ok, N_K, scale, off_b, off_hk, off_h, C,
    MASKED: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    PRECISION: tl.constexpr, TMA: tl.constexpr, S: tl.constexpr,
):
    """Add the key block at start_n's share to dQ; MASKED blocks apply the bounds (and causal, or the spec's)
    masks."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    in_k = offs_n < N_K
    k, v = _load_kv(k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd, start_n, offs_n, in_k, offs_d, d_ok,
                    offs_dv, dv_ok, off_b, off_hk, MASKED, TMA, BLOCK_N, HEAD_DIM, HEAD_DIM_V)
    visible = in_k[None, :]
    if MASKED:
        if S.CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None])
        if S.HAS_MASK:
            visible = visible & S.MASK(offs_m[:, None], offs_n[None, :], off_b, off_h, C)
    _, ds, _, dmod = _score_grads(q, k, do, v, inv_b, delta, m, 0, 0, 0, scale, offs_m[:, None], offs_n[None, :],
                                  off_b, off_h, C, visible, PRECISION, False, MASKED, S)
    if S.HAS_WEIGHT:
        ds = ds * _key_weight(w_base, offs_n, in_k, stride_wn, MASKED)[None, :]
    if MASKED and not S.ONLINE_MAX:
        ds = tl.where(visible, ds, 0.0)
    if S.HAS_SCORE:
        ds = ds * dmod
    return _dot(ds.to(k.dtype), k, dq, PRECISION)


@triton.jit
def _bwd_dq_inner(
    dq, q, do, m, inv_b, delta, k_base, v_base, w_base,
    stride_kn, stride_kd, stride_vn, stride_vd, stride_wn,
    offs_m, lo, full_end, hi, N_K, scale, off_b, off_hk, off_h, C,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, D: tl.constexpr, HEAD_DIM_V: tl.constexpr, DV: tl.constexpr,
    PRECISION: tl.constexpr, TMA: tl.constexpr, S: tl.constexpr,
):
    """dQ over key blocks [lo, full_end) (no mask) and [full_end, hi) (masked). k_base, v_base: descriptors of K, V
    when TMA, else pointers at the head."""
    offs_d, d_ok = _head_columns(HEAD_DIM, D)
    offs_dv, dv_ok = _value_columns(offs_d, d_ok, HEAD_DIM, D, HEAD_DIM_V, DV)
    for start_n in range(lo, full_end, BLOCK_N):
        dq = _dq_block(dq, q, do, m, inv_b, delta, k_base, v_base, w_base, stride_kn, stride_kd, stride_vn, stride_vd,
                       stride_wn, start_n, offs_m, offs_d, d_ok, offs_dv, dv_ok, N_K, scale, off_b, off_hk, off_h, C,
                       False, BLOCK_N, HEAD_DIM, HEAD_DIM_V, PRECISION, TMA, S)
    for start_n in range(full_end, hi, BLOCK_N):
        dq = _dq_block(dq, q, do, m, inv_b, delta, k_base, v_base, w_base, stride_kn, stride_kd, stride_vn, stride_vd,
                       stride_wn, start_n, offs_m, offs_d, d_ok, offs_dv, dv_ok, N_K, scale, off_b, off_hk, off_h, C,
                       True, BLOCK_N, HEAD_DIM, HEAD_DIM_V, PRECISION, TMA, S)
    return dq


@triton.jit
def bwd_dq_kernel(
    Q, K, V, W, O, DO, Z, M, L2, DELTA, DQ,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    stride_wb, stride_wn,
    scale, HQ, GROUP, N_Q, N_K, Q_BUCKET, K_BUCKET, WORK, C, G,
    HEAD_DIM: tl.constexpr, D: tl.constexpr, HEAD_DIM_V: tl.constexpr, DV: tl.constexpr, PRECISION: tl.constexpr,
    TMA: tl.constexpr,
    A1: tl.constexpr, A2: tl.constexpr, DA1: tl.constexpr, DA2: tl.constexpr, B: tl.constexpr,
    DB_OVER_B: tl.constexpr, PRE: tl.constexpr, DPRE: tl.constexpr,
    SCORE: tl.constexpr, DSCORE: tl.constexpr, SCORE_GRADS: tl.constexpr, MASK: tl.constexpr,
    KEY_RANGE: tl.constexpr, QUERY_RANGE: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, ONLINE_MAX: tl.constexpr, EXP2: tl.constexpr,
    SAME_A: tl.constexpr, HAS_PRE: tl.constexpr, HAS_SCORE: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_SCORE_GRADS: tl.constexpr, FOLD: tl.constexpr, DELTA_IN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEADS_FAST: tl.constexpr,
):
    S: tl.constexpr = Spec(A1, A2, DA1, DA2, B, DB_OVER_B, PRE, DPRE, SCORE, DSCORE, SCORE_GRADS, MASK,
                           KEY_RANGE, QUERY_RANGE, CAUSAL, HAS_WEIGHT, ONLINE_MAX, EXP2, SAME_A, HAS_PRE,
                           HAS_SCORE, HAS_MASK, HAS_SCORE_GRADS, FOLD)
    bh, off_b, off_h, off_hk, start_m, offs_m = _query_block_program(HQ, GROUP, BLOCK_M, CAUSAL, HEADS_FAST)
    offs_d, d_ok = _head_columns(HEAD_DIM, D)
    offs_dv, dv_ok = _value_columns(offs_d, d_ok, HEAD_DIM, D, HEAD_DIM_V, DV)
    in_q = offs_m < N_Q

    q_base = _head(Q, off_b, off_h, stride_qb, stride_qh)
    do_base = _head(DO, off_b, off_h, stride_dob, stride_doh)
    if TMA:
        k_base, v_base = K, V
    else:
        k_base = _head(K, off_b, off_hk, stride_kb, stride_kh)
        v_base = _head(V, off_b, off_hk, stride_vb, stride_vh)
    w_base = W + off_b.to(tl.int64) * stride_wb
    q = _load_rows(q_base, offs_m, stride_qm, stride_qd, offs_d, in_q, d_ok)
    do = _load_rows(do_base, offs_m, stride_dom, stride_dod, offs_dv, in_q, dv_ok)
    o = _load_rows(_head(O, off_b, off_h, stride_ob, stride_oh), offs_m, stride_om, stride_od, offs_dv, in_q, dv_ok)
    stat_offs = bh.to(tl.int64) * N_Q + offs_m
    z = tl.load(Z + stat_offs, mask=in_q, other=1.0)
    inv_b = _inv_b(z, B)
    # delta here rather than in a kernel of its own: this kernel runs first and already reads dO, so O is
    # the only extra read, and the dK/dV kernel after it takes delta from DELTA (and l from L2, FOLD)
    delta = _row_delta(o, do, z, DB_OVER_B)
    if DELTA_IN:  # the row statistic's own gradient (runtime.py: the op's second output)
        delta += tl.load(DELTA + stat_offs, mask=in_q, other=0.0)
    if ONLINE_MAX:
        m = tl.load(M + stat_offs, mask=in_q, other=0.0)
        if EXP2:
            m = m * LOG2E
        if FOLD:
            m, delta = _fold_rows(m, inv_b, delta, EXP2)
            tl.store(L2 + stat_offs, m, mask=in_q)
    else:
        m = 0.0
    tl.store(DELTA + stat_offs, delta, mask=in_q)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    if HAS_MASK:
        lo, full_lo, full_hi, hi = KEY_RANGE(offs_m, off_b, off_h, C)
        start, a, b, end = _segments(lo, full_lo, full_hi, hi, N_K, BLOCK_N)
        dq = _bwd_dq_inner(dq, q, do, m, inv_b, delta, k_base, v_base, w_base, stride_kn, stride_kd, stride_vn,
                           stride_vd, stride_wn, offs_m, start, start, a, N_K, scale, off_b, off_hk, off_h, C, BLOCK_N,
                           HEAD_DIM, D, HEAD_DIM_V, DV, PRECISION, TMA, S)
        dq = _bwd_dq_inner(dq, q, do, m, inv_b, delta, k_base, v_base, w_base, stride_kn, stride_kd, stride_vn,
                           stride_vd, stride_wn, offs_m, a, b, end, N_K, scale, off_b, off_hk, off_h, C, BLOCK_N,
                           HEAD_DIM, D, HEAD_DIM_V, DV, PRECISION, TMA, S)
    else:
        full_end, hi = _key_blocks(start_m, N_K, BLOCK_M, BLOCK_N, CAUSAL)
        dq = _bwd_dq_inner(dq, q, do, m, inv_b, delta, k_base, v_base, w_base, stride_kn, stride_kd, stride_vn,
                           stride_vd, stride_wn, offs_m, 0, full_end, hi, N_K, scale, off_b, off_hk, off_h, C,
                           BLOCK_N, HEAD_DIM, D, HEAD_DIM_V, DV, PRECISION, TMA, S)
    dq = dq * scale
    _store_rows(_head(DQ, off_b, off_h, stride_dqb, stride_dqh), dq, offs_m, stride_dqm, stride_dqd, offs_d, in_q, d_ok)


# ---------------------------------------------------------------------------------------------
# Backward: dQ from the stored dS (one program per query block, loops over key blocks): the dK/dV
# kernel ran first with STORE_DS and wrote every dS tile it computed, so this is one product per
# block pair instead of three (S, dP and dS K).
# ---------------------------------------------------------------------------------------------


@triton.jit
def _bwd_dq_ds_inner(
    dq, ds_src, k_base, stride_dsn, stride_kn, stride_kd, start_m, lo, hi, N_Q, N_K, bh, off_b, off_hk,
    MASKED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, D: tl.constexpr,
    PRECISION: tl.constexpr, TMA: tl.constexpr, CAUSAL: tl.constexpr,
):
    """ds_src, k_base: descriptors of dS, K when TMA, else pointers at the head's planes. MASKED blocks keep
    only visible, in-bounds entries: the dK/dV kernel never wrote the tiles' other entries."""
    offs_d, d_ok = _head_columns(HEAD_DIM, D)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if TMA:
            ds_t = ds_src.load([bh, start_n, start_m]).reshape(BLOCK_N, BLOCK_M)
            k = k_base.load([off_b, off_hk, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        else:
            ds_t = tl.load(ds_src + offs_n[:, None] * stride_dsn + offs_m[None, :],
                           mask=(offs_n[:, None] < N_K) & (offs_m[None, :] < N_Q), other=0.0)
            k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                        mask=(offs_n[:, None] < N_K) & d_ok, other=0.0)
        if MASKED:
            visible = (offs_n[:, None] < N_K) & (offs_m[None, :] < N_Q)
            if CAUSAL:
                visible = visible & (offs_n[:, None] <= offs_m[None, :])
            ds_t = tl.where(visible, ds_t, 0.0)
        dq = _dot(tl.trans(ds_t), k, dq, PRECISION)
    return dq


@triton.jit
def bwd_dq_ds_kernel(
    DS, K, DQ,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    stride_dsn,
    scale, HQ, GROUP, N_Q, N_K, Q_BUCKET, K_BUCKET, WORK,
    HEAD_DIM: tl.constexpr, D: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEADS_FAST: tl.constexpr,
):
    """dQ_i = scale sum_j dS_ij K_j from DS [B * Hq, Nk, Nq] (row stride stride_dsn); DS and K are descriptors
    when TMA."""
    bh, off_b, off_h, off_hk, start_m, offs_m = _query_block_program(HQ, GROUP, BLOCK_M, CAUSAL, HEADS_FAST)
    offs_d, d_ok = _head_columns(HEAD_DIM, D)
    if TMA:
        ds_src, k_base = DS, K
    else:
        ds_src = DS + bh.to(tl.int64) * N_K * stride_dsn
        k_base = _head(K, off_b, off_hk, stride_kb, stride_kh)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    full_end, hi = _key_blocks(start_m, N_K, BLOCK_M, BLOCK_N, CAUSAL)
    dq = _bwd_dq_ds_inner(
        dq, ds_src, k_base, stride_dsn, stride_kn, stride_kd, start_m, 0, full_end, N_Q, N_K, bh, off_b, off_hk,
        False, BLOCK_M, BLOCK_N, HEAD_DIM, D, PRECISION, TMA, CAUSAL,
    )
    dq = _bwd_dq_ds_inner(
        dq, ds_src, k_base, stride_dsn, stride_kn, stride_kd, start_m, full_end, hi, N_Q, N_K, bh, off_b, off_hk,
        True, BLOCK_M, BLOCK_N, HEAD_DIM, D, PRECISION, TMA, CAUSAL,
    )
    dq = dq * scale
    dq_base = _head(DQ, off_b, off_h, stride_dqb, stride_dqh)
    tl.store(dq_base + offs_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqd, dq.to(DQ.dtype.element_ty),
             mask=(offs_m < N_Q)[:, None] & d_ok)


# ---------------------------------------------------------------------------------------------
# Backward, fused (deterministic_bwd off): one program per key block computes dK, dV as above
# and adds dQ_i += dS_ij K_j for each query block into an fp32 buffer with atomics, so S and dP are
# computed once per block pair (5 matrix products instead of 7). A cast kernel applies the scale and
# writes dQ in the input dtype.
# ---------------------------------------------------------------------------------------------


@triton.jit
def _bwd_fused_inner(
    dk, dv, k, v, w, in_k, q_base, do_base, dqa_base, z_base, m_base, delta_base,
    stride_qm, stride_qd, stride_dom, stride_dod,
    offs_n, lo, n_steps, rot, N_Q, scale, off_b, off_h, C, G,
    MASKED: tl.constexpr, KEY_MASK: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, DV: tl.constexpr, PRECISION: tl.constexpr, S: tl.constexpr,
):
    """Query blocks lo + ((i + rot) mod n_steps) * BLOCK_M for i < n_steps (rot staggers the programs
    of one head so that their atomics do not hit the same dQ rows at the same time)."""
    offs_d, d_ok = _head_columns(HEAD_DIM, D)
    offs_dv, dv_ok = _value_columns(offs_d, d_ok, HEAD_DIM, D, HEAD_DIM_V, DV)
    for i in range(n_steps):
        start_m = lo + (i + rot) % n_steps * BLOCK_M
        start_m = tl.multiple_of(start_m, BLOCK_M)
        dk, dv, ds_c, offs_m, in_q = _dkdv_block(
            dk, dv, k, v, w, in_k, q_base, do_base, z_base, m_base, delta_base, stride_qm, stride_qd, stride_dom,
            stride_dod, start_m, offs_n, offs_d, d_ok, offs_dv, dv_ok, N_Q, scale, off_b, off_h, C, G, MASKED,
            KEY_MASK, BLOCK_M, HEAD_DIM, HEAD_DIM_V, PRECISION, False, S)
        dq = _dot(tl.trans(ds_c), k, None, PRECISION)  # [BLOCK_M, HEAD_DIM]
        tl.atomic_add(dqa_base + offs_m[:, None] * HEAD_DIM + offs_d[None, :], dq, mask=in_q[:, None] & d_ok,
                      sem="relaxed")
    return dk, dv


@triton.jit
def _bwd_fused_heads(
    dk, dv, k, v, w, in_k, Q, DO, DQA, Z, M, DELTA, off_b, off_hk, rot,
    stride_qb, stride_qh, stride_qm, stride_qd, stride_dob, stride_doh, stride_dom, stride_dod,
    start_n, HQ, GROUP, N_Q, scale, C, G,
    KEY_MASK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, DV: tl.constexpr, PRECISION: tl.constexpr, S: tl.constexpr,
):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if S.HAS_MASK:
        pass  # ranges per query head, below
    elif S.CAUSAL:
        lo, diag_end = _query_blocks(start_n, N_Q, BLOCK_M, BLOCK_N, True)
        n_diag = tl.maximum(diag_end - lo, 0) // BLOCK_M
        n_rest = tl.maximum(N_Q - diag_end + BLOCK_M - 1, 0) // BLOCK_M
    else:
        n_blocks = (N_Q + BLOCK_M - 1) // BLOCK_M
    for g in range(GROUP):
        off_h, _, q_base, do_base, stat_base = _query_head(Q, DO, off_b, off_hk, g, stride_qb, stride_qh, stride_dob,
                                                           stride_doh, HQ, GROUP, N_Q, False)
        dqa_base = DQA + stat_base * HEAD_DIM
        if S.HAS_MASK:  # the spec's mask: masked query blocks [start, a) and [b, end), unmasked [a, b)
            q_lo, q_full_lo, q_full_hi, q_hi = S.QUERY_RANGE(offs_n, off_b, off_h, C)
            start, a, b, end = _segments(q_lo, q_full_lo, q_full_hi, q_hi, N_Q, BLOCK_M)
            dk, dv = _bwd_fused_inner(
                dk, dv, k, v, w, in_k, q_base, do_base, dqa_base, Z + stat_base, M + stat_base, DELTA + stat_base,
                stride_qm, stride_qd, stride_dom, stride_dod, offs_n, start, (a - start) // BLOCK_M, 0, N_Q, scale,
                off_b, off_h, C, G, True, KEY_MASK, BLOCK_M, HEAD_DIM, D, HEAD_DIM_V, DV, PRECISION, S,
            )
            dk, dv = _bwd_fused_inner(
                dk, dv, k, v, w, in_k, q_base, do_base, dqa_base, Z + stat_base, M + stat_base, DELTA + stat_base,
                stride_qm, stride_qd, stride_dom, stride_dod, offs_n, a, (b - a) // BLOCK_M, 0, N_Q, scale,
                off_b, off_h, C, G, False, KEY_MASK, BLOCK_M, HEAD_DIM, D, HEAD_DIM_V, DV, PRECISION, S,
            )
            dk, dv = _bwd_fused_inner(
                dk, dv, k, v, w, in_k, q_base, do_base, dqa_base, Z + stat_base, M + stat_base, DELTA + stat_base,
                stride_qm, stride_qd, stride_dom, stride_dod, offs_n, b, (end - b) // BLOCK_M, 0, N_Q, scale,
                off_b, off_h, C, G, True, KEY_MASK, BLOCK_M, HEAD_DIM, D, HEAD_DIM_V, DV, PRECISION, S,
            )
        elif S.CAUSAL:
            dk, dv = _bwd_fused_inner(
                dk, dv, k, v, w, in_k, q_base, do_base, dqa_base, Z + stat_base, M + stat_base, DELTA + stat_base,
                stride_qm, stride_qd, stride_dom, stride_dod, offs_n, lo, n_diag, 0, N_Q, scale, off_b, off_h, C, G,
                True, KEY_MASK, BLOCK_M, HEAD_DIM, D, HEAD_DIM_V, DV, PRECISION, S,
            )
            dk, dv = _bwd_fused_inner(
                dk, dv, k, v, w, in_k, q_base, do_base, dqa_base, Z + stat_base, M + stat_base, DELTA + stat_base,
                stride_qm, stride_qd, stride_dom, stride_dod, offs_n, diag_end, n_rest, 0, N_Q, scale, off_b, off_h,
                C, G, False, KEY_MASK, BLOCK_M, HEAD_DIM, D, HEAD_DIM_V, DV, PRECISION, S,
            )
        else:
            dk, dv = _bwd_fused_inner(
                dk, dv, k, v, w, in_k, q_base, do_base, dqa_base, Z + stat_base, M + stat_base, DELTA + stat_base,
                stride_qm, stride_qd, stride_dom, stride_dod, offs_n, 0, n_blocks, rot % n_blocks, N_Q, scale,
                off_b, off_h, C, G, False, KEY_MASK, BLOCK_M, HEAD_DIM, D, HEAD_DIM_V, DV, PRECISION, S,
            )
    return dk, dv


@triton.jit
def bwd_fused_kernel(
    Q, K, V, W, DO, Z, M, DELTA, DK, DV_GRAD, DQA,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    stride_wb, stride_wn,
    scale, HQ, HKV, GROUP, N_Q, N_K, Q_BUCKET, K_BUCKET, WORK, C, G,
    HEAD_DIM: tl.constexpr, D: tl.constexpr, HEAD_DIM_V: tl.constexpr, DV: tl.constexpr, PRECISION: tl.constexpr,
    A1: tl.constexpr, A2: tl.constexpr, DA1: tl.constexpr, DA2: tl.constexpr, B: tl.constexpr,
    DB_OVER_B: tl.constexpr, PRE: tl.constexpr, DPRE: tl.constexpr,
    SCORE: tl.constexpr, DSCORE: tl.constexpr, SCORE_GRADS: tl.constexpr, MASK: tl.constexpr,
    KEY_RANGE: tl.constexpr, QUERY_RANGE: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, ONLINE_MAX: tl.constexpr, EXP2: tl.constexpr,
    SAME_A: tl.constexpr, HAS_PRE: tl.constexpr, HAS_SCORE: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_SCORE_GRADS: tl.constexpr, FOLD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEADS_FAST: tl.constexpr,
):
    S: tl.constexpr = Spec(A1, A2, DA1, DA2, B, DB_OVER_B, PRE, DPRE, SCORE, DSCORE, SCORE_GRADS, MASK,
                           KEY_RANGE, QUERY_RANGE, CAUSAL, HAS_WEIGHT, ONLINE_MAX, EXP2, SAME_A, HAS_PRE,
                           HAS_SCORE, HAS_MASK, HAS_SCORE_GRADS, FOLD)
    _, off_b, off_hk, pid_n, start_n, offs_n = _key_block_program(HKV, BLOCK_N, HEADS_FAST)
    offs_d, d_ok = _head_columns(HEAD_DIM, D)
    offs_dv, dv_ok = _value_columns(offs_d, d_ok, HEAD_DIM, D, HEAD_DIM_V, DV)
    in_k = offs_n < N_K
    k, v, w = _load_key_block(K, V, W, off_b, off_hk, offs_n, offs_d, d_ok, offs_dv, dv_ok, in_k, stride_kb,
                              stride_kh, stride_kn, stride_kd, stride_vb, stride_vh, stride_vn, stride_vd, stride_wb,
                              stride_wn, HAS_WEIGHT)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_V], dtype=tl.float32)
    # a key block within N_K compiles without the key mask
    if start_n + BLOCK_N <= N_K:
        dk, dv = _bwd_fused_heads(
            dk, dv, k, v, w, in_k, Q, DO, DQA, Z, M, DELTA, off_b, off_hk, pid_n,
            stride_qb, stride_qh, stride_qm, stride_qd, stride_dob, stride_doh, stride_dom, stride_dod,
            start_n, HQ, GROUP, N_Q, scale, C, G, False, BLOCK_M, BLOCK_N, HEAD_DIM, D, HEAD_DIM_V, DV, PRECISION, S,
        )
    else:
        dk, dv = _bwd_fused_heads(
            dk, dv, k, v, w, in_k, Q, DO, DQA, Z, M, DELTA, off_b, off_hk, pid_n,
            stride_qb, stride_qh, stride_qm, stride_qd, stride_dob, stride_doh, stride_dom, stride_dod,
            start_n, HQ, GROUP, N_Q, scale, C, G, True, BLOCK_M, BLOCK_N, HEAD_DIM, D, HEAD_DIM_V, DV, PRECISION, S,
        )
    dk = dk * scale
    _store_key_block(DK, DV_GRAD, dk, dv, off_b, off_hk, offs_n, offs_d, d_ok, offs_dv, dv_ok, in_k, stride_dkb,
                     stride_dkh, stride_dkn, stride_dkd, stride_dvb, stride_dvh, stride_dvn, stride_dvd)


@triton.jit
def bwd_dq_cast_kernel(
    DQA, DQ, stride_dqb, stride_dqh, stride_dqm, stride_dqd, scale, HQ, N_Q,
    HEAD_DIM: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """dQ = scale * (fp32 accumulator), in the input dtype and dQ's strides."""
    bh, off_b, off_h, _, _, offs_m = _query_block_program(HQ, 1, BLOCK_M, False, False)
    offs_d, d_ok = _head_columns(HEAD_DIM, D)
    in_q = offs_m < N_Q
    rows = bh.to(tl.int64) * N_Q + offs_m
    dq = tl.load(DQA + rows[:, None] * HEAD_DIM + offs_d[None, :], mask=in_q[:, None] & d_ok, other=0.0) * scale
    _store_rows(_head(DQ, off_b, off_h, stride_dqb, stride_dqh), dq, offs_m, stride_dqm, stride_dqd, offs_d, in_q, d_ok)


# ---------------------------------------------------------------------------------------------
# Backward: the per-key weight's gradient, launched only when the weight requires grad (either form; from the saved
# statistics): dw_j = sum_i [a1(x_ij) (dO_i . v_j) / b(z_i) - a2(x_ij) delta_i] over the queries that see key j. One
# program per (key block, batch * kv head); the host sums over kv heads.
# ---------------------------------------------------------------------------------------------


@triton.jit
def bwd_dw_kernel(
    Q, K, V, DO, Z, M, DELTA, DW,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    scale, HQ, HKV, GROUP, N_Q, N_K, C,
    HEAD_DIM: tl.constexpr, D: tl.constexpr, HEAD_DIM_V: tl.constexpr, DV: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    A1: tl.constexpr, A2: tl.constexpr, DA1: tl.constexpr, DA2: tl.constexpr, B: tl.constexpr,
    DB_OVER_B: tl.constexpr, PRE: tl.constexpr, DPRE: tl.constexpr,
    SCORE: tl.constexpr, DSCORE: tl.constexpr, SCORE_GRADS: tl.constexpr, MASK: tl.constexpr,
    KEY_RANGE: tl.constexpr, QUERY_RANGE: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, ONLINE_MAX: tl.constexpr, EXP2: tl.constexpr,
    SAME_A: tl.constexpr, HAS_PRE: tl.constexpr, HAS_SCORE: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_SCORE_GRADS: tl.constexpr, FOLD: tl.constexpr,
):
    bhk, off_b, off_hk, _, start_n, offs_n = _key_block_program(HKV, BLOCK_N, False)
    offs_d, d_ok = _head_columns(HEAD_DIM, D)
    offs_dv, dv_ok = _value_columns(offs_d, d_ok, HEAD_DIM, D, HEAD_DIM_V, DV)
    in_k = offs_n < N_K
    k, v, _ = _load_key_block(K, V, K, off_b, off_hk, offs_n, offs_d, d_ok, offs_dv, dv_ok, in_k, stride_kb,
                              stride_kh, stride_kn, stride_kd, stride_vb, stride_vh, stride_vn, stride_vd, 0, 0, False)
    lo, _ = _query_blocks(start_n, N_Q, BLOCK_M, BLOCK_N, CAUSAL)  # earlier queries see none of these keys
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    for g in range(GROUP):
        off_h, _, q_base, do_base, stat_base = _query_head(Q, DO, off_b, off_hk, g, stride_qb, stride_qh, stride_dob,
                                                           stride_doh, HQ, GROUP, N_Q, False)
        for start_m in range(lo, N_Q, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            in_q = offs_m < N_Q
            q = _load_rows(q_base, offs_m, stride_qm, stride_qd, offs_d, in_q, d_ok)
            do = _load_rows(do_base, offs_m, stride_dom, stride_dod, offs_dv, in_q, dv_ok)
            inv_b = _inv_b(tl.load(Z + stat_base + offs_m, mask=in_q, other=1.0), B)
            delta = tl.load(DELTA + stat_base + offs_m, mask=in_q, other=0.0)
            visible = in_k[:, None] & in_q[None, :]
            if CAUSAL:
                visible = visible & (offs_m[None, :] >= offs_n[:, None])
            if HAS_MASK:
                visible = visible & MASK(offs_m[None, :], offs_n[:, None], off_b, off_h, C)
            x_t = _dot(k, tl.trans(q), None, PRECISION) * scale  # [BLOCK_N, BLOCK_M]
            if HAS_SCORE:
                x_t = SCORE(x_t, offs_m[None, :], offs_n[:, None], off_b, off_h, C)
            if HAS_PRE:
                x_t = PRE(x_t)
            if ONLINE_MAX:
                x_t = x_t - tl.load(M + stat_base + offs_m, mask=in_q, other=0.0)[None, :]
            x_t = tl.where(visible, x_t, 0.0)  # hidden scores may exceed the row max: never exponentiated
            dp_t = _dot(v, tl.trans(do), None, PRECISION)  # dO_i . v_j
            term = A1(x_t) * dp_t * inv_b[None, :] - A2(x_t) * delta[None, :]
            dw += tl.sum(tl.where(visible, term, 0.0), 1)
    tl.store(DW + bhk.to(tl.int64) * N_K + offs_n, dw, mask=in_k)


# ---------------------------------------------------------------------------------------------
# Autotuning: one autotuner per op and kernel
# ---------------------------------------------------------------------------------------------

# which tensors each kernel reads or writes through descriptors, and the tile axis of their rows ([B, H, N, D]
# tensors), or the two tile axes of a tile of the stored dS ([B * Hq, Nk, Nq], rows are keys)
_TMA_ROWS: dict[str, dict[str, Any]] = {
    "fwd": {"Q": "BLOCK_M", "O": "BLOCK_M", "K": "BLOCK_N", "V": "BLOCK_N"},
    "dkdv": {"Q": "BLOCK_M", "DO": "BLOCK_M", "DS": ("BLOCK_N", "BLOCK_M")},
    "dq": {"K": "BLOCK_N", "V": "BLOCK_N"}, "dq_ds": {"K": "BLOCK_N", "DS": ("BLOCK_N", "BLOCK_M")}}
# the tile constexpr of each descriptor's columns: v, o and dO are DV wide, q and k D
_TMA_COLUMNS = {"V": "HEAD_DIM_V", "O": "HEAD_DIM_V", "DO": "HEAD_DIM_V"}
DELTA_BLOCK_M = 16 if _INTERPRET else 64


# kernels that add the modifier tensors' gradients into G with atomics: every run starts from zero (the autotuner
# runs a config many times; the real launch finds the buffers zeroed as well)
_ACCUMULATES_G = ("dkdv", "fused")


def _zero_gradient_buffers(nargs: dict) -> None:
    for buffer in nargs.get("G") or ():
        if isinstance(buffer, torch.Tensor):
            buffer.zero_()


def _tma_hook(kind: str) -> Callable | None:
    """Autotune pre-hook: the descriptors get the tile of the config being run; kernels that accumulate modifier
    gradients start from zeroed buffers."""
    rows = _TMA_ROWS.get(kind)
    if rows is None:
        return _zero_gradient_buffers if kind in _ACCUMULATES_G else None

    def hook(nargs: dict) -> None:
        if kind in _ACCUMULATES_G:
            _zero_gradient_buffers(nargs)
        for name, axis in rows.items():
            if TensorDescriptor is not None and isinstance(nargs[name], TensorDescriptor):
                if isinstance(axis, tuple):
                    nargs[name].block_shape = [1, nargs[axis[0]], nargs[axis[1]]]
                else:
                    nargs[name].block_shape = [1, 1, nargs[axis], nargs[_TMA_COLUMNS.get(name, "HEAD_DIM")]]
    return hook


def tile_configs(kind: str, tiles: tuple[Tile, ...]) -> list:
    hook = _tma_hook(kind)
    if _INTERPRET:  # one small config: the CPU interpreter is slow and autotuning is pointless there
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "HEADS_FAST": 0}, num_warps=4, num_stages=1,
                              pre_hook=hook)]
    return [triton.Config({"BLOCK_M": c[0], "BLOCK_N": c[1], "HEADS_FAST": c[4] if len(c) > 4 else 0},
                          num_warps=c[2], num_stages=c[3], pre_hook=hook) for c in tiles]


def _prune(configs: list, named_args: dict, **kwargs: Any) -> list:
    """Drop tiles larger than the (power-of-two bucketed) sequence lengths. Where one config or none is left, the
    smallest tile is kept beside it: a lone config is launched untimed, and at fp32 and head dim 128 the one that
    fits the lengths may not fit the shared memory (the autotuner skips a config that does not, among several).
    Where every kept config looks too large for the shared memory (fp32 at a 192-wide head: MLA), a small
    single-stage tile joins them, so that one config always fits."""
    q_bucket, k_bucket = named_args["Q_BUCKET"], named_args["K_BUCKET"]
    kept = [c for c in configs if c.kwargs["BLOCK_M"] <= q_bucket and c.kwargs["BLOCK_N"] <= k_bucket]
    if len(kept) <= 1 and len(configs) > 1:
        smallest = min(configs, key=lambda c: (c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"], c.num_stages))
        kept = [*kept, smallest] if smallest not in kept else kept
    kept = kept or configs[-1:]
    row_bytes = _element_bytes(named_args) * (kwargs.get("HEAD_DIM", 128) + kwargs.get("HEAD_DIM_V", 0))
    limit = shared_memory_limit()
    if all(shared_memory_estimate(c, row_bytes) > limit for c in kept):
        base = kept[0]
        kept = [*kept, triton.Config({**base.kwargs, "BLOCK_M": SAFE_TILE, "BLOCK_N": SAFE_TILE}, num_warps=4,
                                     num_stages=1, pre_hook=base.pre_hook)]
    return kept


# rows and keys of the config that fits any head this family runs (fp32, 256 + 256 wide rows: 128 KiB by the
# estimate below)
SAFE_TILE = 32


def shared_memory_estimate(config: Any, row_bytes: int) -> int:
    """A rough upper bound of a config's shared memory: the pipelined tile (the smaller block) once per stage, the
    resident one once, each row `row_bytes` wide (q and v, or k and v, or q and dO). A trigger for `_prune`'s
    fallback, not a prediction: Triton's own count decides which configs run."""
    rows = sorted((config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]))
    return row_bytes * (config.num_stages * rows[0] + rows[1])


def shared_memory_limit() -> int:
    """The current device's shared memory per block (opt-in), or the H100's 232,448 bytes where unknown."""
    if not torch.cuda.is_available():
        return 232_448
    index = torch.cuda.current_device()
    if index not in _SHARED_MEMORY:
        props = torch.cuda.get_device_properties(index)
        _SHARED_MEMORY[index] = int(getattr(props, "shared_memory_per_block_optin", 232_448))
    return _SHARED_MEMORY[index]


_SHARED_MEMORY: dict[int, int] = {}


def _element_bytes(named_args: dict) -> int:
    """Bytes per element of the kernel's first tensor argument (Q, or dS for the dQ-from-dS kernel); 2 where
    it is a bulk-copy descriptor (whose block holds no dtype here)."""
    for value in named_args.values():
        if isinstance(value, torch.Tensor):
            return value.element_size()
        base = getattr(value, "base", None)
        if isinstance(base, torch.Tensor):
            return base.element_size()
    return 2


# WORK (batch * query heads, rounded up to a power of two) is in the key so that a config tuned on a small call
# is not reused on a large one: tuned on bench/attention.py's check (B 2, H 4, N 1000), the dQ kernel kept a tile
# that ran 583 us against 475 at B 32, H 16, N 1024 (causal spherical, H100, bench/log/2026-11-20-to-22.md).
# Ops that share these kernels never share a tuning result: each op has its own autotuners (their own caches), and
# the spec's maps are in every key (their repr names the op's module, so an on-disk tuning cache keyed by the key's
# text keeps them apart as well).
TUNE_KEY = ["HEAD_DIM", "Q_BUCKET", "K_BUCKET", "WORK", "PRECISION"]
VALUE_KEY = ["HEAD_DIM_V"]  # (the kernels that read v, o or dO: all but the dQ-from-dS one)
HOOK_KEY = ["A1", "A2", "B", "PRE", "SCORE", "MASK", "HAS_SCORE_GRADS"]


def autotuned(kernel: Any, configs: list, key: list[str], prune: Callable = _prune, **options: Any) -> Any:
    """`kernel` autotuned over `configs` for one op (its own Autotuner and cache)."""
    return autotune(name="attention", configs=configs, key=key, prune_configs_by={"early_config_prune": prune},
                    **options)(kernel)


# ---------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------

_CAPABILITY: dict = {}


def _pow2_at_least_16(n: int) -> int:
    """max(16, the next power of two >= n) in plain ints (triton.next_power_of_2 is a constexpr function, about
    ten times slower, and the launches call this several times each)."""
    return max(16, 1 << (max(int(n), 1) - 1).bit_length())


def head_tile(d: int) -> int:
    """The head-dim tile the kernels run at: a power of two, at least 16 (tl.arange and tl.dot need both)."""
    return _pow2_at_least_16(d)


def bucket(n: int) -> int:
    return _pow2_at_least_16(n)


def grid_order(blocks: int, heads: int, meta: dict) -> tuple[int, int]:
    return (heads, blocks) if meta["HEADS_FAST"] else (blocks, heads)


def tma_ok(*tensors: torch.Tensor, use_tma: bool = True) -> bool:
    """Bulk copies need unit stride in D, 16-byte aligned strides and base, and a Hopper-class GPU."""
    if not use_tma or TensorDescriptor is None:
        return False
    if not _INTERPRET:
        if not tensors[0].is_cuda:
            return False
        index = tensors[0].device.index
        if index not in _CAPABILITY:  # queried per call, it took 25 us a call under cProfile
            _CAPABILITY[index] = torch.cuda.get_device_capability(tensors[0].device)
        if _CAPABILITY[index][0] < 9:
            return False
    for t in tensors:
        size = t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any(s * size % 16 for s in t.stride()[:-1]):
            return False
    return True


def descriptor(t: torch.Tensor, tma: bool) -> Any:
    """A TMA descriptor of the [B, H, N, D] (or [B, H, N, DV]) tensor t (placeholder tile, the width t's own: the
    config's pre-hook sets it), or t."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, 16, head_tile(t.shape[-1])]) if tma else t


def ds_descriptor(ds: torch.Tensor, n_q: int) -> Any:
    """A TMA descriptor of the stored dS [B * Hq, Nk, Nq] (its rows padded past Nq; placeholder tile)."""
    return TensorDescriptor(ds, [ds.shape[0], ds.shape[1], n_q], list(ds.stride()), [1, 16, 16])


def weight_arg(w: torch.Tensor | None, q: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
    """(pointer argument, strides) for the weight; q stands in when there is no weight."""
    if w is None:
        return q, (0, 0)
    w = w.to(torch.float32)
    return w, (w.stride(0), w.stride(1))


def save_for_backward(ctx: Any, inputs: tuple, output: tuple) -> None:
    """Keep inputs (q, k, v, w, scale) and output (o and the statistics, flat) for `saved_backward`: Attention,
    FactorizedAttention and the op's custom ops share it, so that what they save cannot drift apart."""
    q, k, v, w, scale = inputs
    ctx.set_materialize_grads(False)  # the statistics get no gradient: no zero-filled buffers for them
    ctx.save_for_backward(q, k, v, w, *output)
    ctx.scale = scale


class AttentionKernels:
    """The kernels above launched for one op: `maps` are its device functions (A1 ... DPRE; PRE and DPRE None
    without a pre-map), `config` what the plan chose (the backward's form, the dS buffer limit, TMA; tests change
    them through the config), `namespace` its generated module's globals, whose `forward` /
    `backward_from_saved` the autograd Functions call (so a test that replaces them sees its replacement used)."""

    def __init__(self, name: str, config: AttentionConfig, maps: dict[str, Any], namespace: dict[str, Any], *,
                 causal: bool, has_weight: bool, has_score: bool = False, has_mask: bool = False,
                 mask_hides: bool = True, has_score_grads: bool = False) -> None:
        missing, unknown = set(MAPS[:6]) - set(maps), set(maps) - set(MAPS) - set(HOOKS)
        if missing or unknown:
            raise ValueError(f"{name}: the maps are {', '.join(MAPS)} (PRE and DPRE optional) and the hooks "
                             f"{', '.join(HOOKS)}; missing {sorted(missing)}, unknown {sorted(unknown)}")
        if (maps.get("PRE") is None) != (maps.get("DPRE") is None):
            raise ValueError(f"{name}: PRE and DPRE come together")
        needed = [h for h, on in (("SCORE", has_score), ("DSCORE", has_score), ("SCORE_GRADS", has_score),
                                  ("MASK", has_mask), ("KEY_RANGE", has_mask), ("QUERY_RANGE", has_mask)) if on]
        if [h for h in needed if maps.get(h) is None] or (causal and has_mask):
            raise ValueError(f"{name}: a score modifier takes SCORE, DSCORE, SCORE_GRADS and a mask MASK, KEY_RANGE, "
                             "QUERY_RANGE (modifiers.py); the causal flag and a mask hook exclude each other")
        self.name, self.config, self.ns = name, config, namespace
        self.causal, self.has_weight, self.modified = causal, has_weight, has_score or has_mask
        self.mask_hides = has_mask and mask_hides  # (False: the always-true hook of a score modifier: modifiers.py)
        has_pre = maps.get("PRE") is not None
        self.maps = {**{h: identity for h in HOOKS}, **maps, "PRE": maps.get("PRE") or identity,
                     "DPRE": maps.get("DPRE") or identity}
        self.flags = dict(zip(FLAGS, (causal, has_weight, config.online_max, config.exp2, config.shared_map, has_pre,
                                      has_score, has_mask, has_score_grads, config.fold), strict=True))
        self.spec = {**self.maps, **self.flags}  # the constexprs every map-evaluating kernel takes
        # the forward streams in base 2 wherever the maps are exp (FOLD), after a score modifier or a pre-map too
        # (it applies them to the natural score first); the backward's EXP2 leaves those out (`_score_grads`)
        self.forward_spec = {**self.spec, "EXP2": config.exp2 or (config.fold and (has_score or has_pre))}
        self.spec_without_grads = {**self.spec, "HAS_SCORE_GRADS": False}  # a backward with no gradient buffers
        key, c = [*TUNE_KEY, *VALUE_KEY, *HOOK_KEY], config
        forward_tiles = c.forward_tiles + tuple(t for t in MEASURED_FORWARD_TILES if t not in c.forward_tiles)
        self.fwd_kernel = autotuned(fwd_kernel, tile_configs("fwd", forward_tiles), [*key, "TMA"])
        self.bwd_dkdv_kernel = autotuned(bwd_dkdv_kernel, tile_configs("dkdv", c.dkdv_tiles),
                                         [*key, "TMA", "STORE_DS", "DS_BULK"])
        self.bwd_dq_kernel = autotuned(bwd_dq_kernel, tile_configs("dq", c.dq_tiles), [*key, "TMA"])
        # (no maps: the same kernel for every op of a mask)
        self.bwd_dq_ds_kernel = autotuned(bwd_dq_ds_kernel, tile_configs("dq_ds", c.dq_ds_tiles),
                                          [*TUNE_KEY, "TMA", "CAUSAL"])
        # reset_to_zero: the autotuner runs each config several times; the accumulator must start at zero for the
        # real launch (the delta kernel zeroed it before the first).
        self.bwd_fused_kernel = autotuned(bwd_fused_kernel, tile_configs("fused", c.fused_tiles), key,
                                          reset_to_zero=["DQA"])

    def without_causal(self) -> AttentionKernels:
        """These kernels with the causal flag off, sharing everything else (context parallelism's blocks of keys
        that wholly precede their queries: ring.py)."""
        if not self.causal:
            return self
        other = copy.copy(self)
        other.causal = False
        other.flags = {**self.flags, "CAUSAL": False}
        other.spec = {**self.spec, "CAUSAL": False}
        other.forward_spec = {**self.forward_spec, "CAUSAL": False}
        other.spec_without_grads = {**self.spec_without_grads, "CAUSAL": False}
        return other

    # -- allocation and copies ----------------------------------------------------------------------------------

    def new(self, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype, device=device)
        if _settings.POISON_OUTPUTS:  # NCD_POISON_OUTPUTS / ncd.settings.poisoned(): unwritten elements show as NaN
            out.fill_(float("nan"))
        return out

    def tma_ok(self, *tensors: torch.Tensor) -> bool:
        return tma_ok(*tensors, use_tma=self.config.use_tma)

    def precision(self, dtype: torch.dtype) -> str:
        return self.config.fp32_precision if dtype == torch.float32 else self.config.low_precision

    def shapes(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor | None) -> tuple:
        """(batch, query heads, kv heads, N_Q, N_K, D) of q, k [B, H, N, D] and v [B, H, N, DV] (DV, the value
        width, may differ from D: `value_dim`)."""
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            raise ValueError("q, k must be [B, H, N, D] and v [B, H, N, DV]")
        batch, hq, n_q, head_dim = q.shape
        hkv, n_k = k.shape[1], k.shape[2]
        if tuple(v.shape[:3]) != tuple(k.shape[:3]) or k.shape[0] != batch or k.shape[3] != head_dim:
            raise ValueError(f"incompatible shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
        if hq % hkv != 0:
            raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
        if self.has_weight:
            if w is None or tuple(w.shape) != (batch, n_k):
                raise ValueError(f"{self.name} needs a per-key weight w of shape {(batch, n_k)}")
        elif w is not None:
            raise ValueError(f"{self.name} was compiled without a per-key weight; got w")
        return batch, hq, hkv, n_q, n_k, head_dim

    # -- streamed form ----------------------------------------------------------------------------------------

    def _context(self, context: tuple | None) -> tuple:
        if self.modified and not context:
            raise ValueError(f"{self.name}: the spec's score or mask modifiers read the call's context tuple "
                             "(ncd/families/attention/runtime.py builds it); call the op, not the bare kernels")
        return context or ()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor | None = None,
                scale: float | None = None, context: tuple | None = None, sink: tuple | None = None) -> tuple:
        """o = attention(q, k, v); returns (o, stats) with stats = (z, m) for the backward (m: None without the
        running max). context: what the spec's modifier hooks read (modifiers.py), None without. sink: (logits as
        a [B, H, N_Q] view or None, the constant place, u(logit)) of a sink the stream starts from
        (kernel_sink.forward_sink)."""
        context = self._context(context)
        batch, hq, hkv, n_q, n_k, head_dim = self.shapes(q, k, v, w)
        value_dim = v.shape[3]
        scale = head_dim**-0.5 if scale is None else float(scale)
        online_max = self.config.online_max
        o = self.new((batch, hq, n_q, value_dim), q.dtype, q.device)
        z = self.new((batch, hq, n_q), torch.float32, q.device)
        m = self.new((batch, hq, n_q), torch.float32, q.device) if online_max else None
        w_arg, w_strides = weight_arg(w, q)

        def grid(meta: dict) -> tuple:
            return grid_order(triton.cdiv(n_q, meta["BLOCK_M"]), batch * hq, meta)

        tma = self.tma_ok(q, k, v, o)
        srcs = [descriptor(t, tma) for t in (q, k, v, o)]
        logits, place, sink_map = sink if sink is not None else (None, 0.0, None)
        sink_args = (logits, *logits.stride(), 0.0) if logits is not None else (z, 0, 0, 0, float(place))
        fast(self.fwd_kernel)[grid](
            srcs[0], srcs[1], srcs[2], w_arg, srcs[3], z, m if m is not None else z,
            *q.stride(), *k.stride(), *v.stride(), *o.stride(), *w_strides,
            scale, hq, hq // hkv, n_q, n_k, bucket(n_q), bucket(n_k), bucket(batch * hq), context, (),
            *sink_args, HEAD_DIM=head_tile(head_dim), D=head_dim, HEAD_DIM_V=head_tile(value_dim), DV=value_dim,
            PRECISION=self.precision(q.dtype), NEG_SCALE=scale < 0, UNIT_SCALE=scale == 1.0, TMA=tma,
            SINK=0 if sink is None else 1 if logits is None else 2, SINK_MAP=sink_map or identity,
            **self.forward_spec,
        )
        return o, (z, m)

    def backward(self, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                 stats: tuple, w: torch.Tensor | None = None, scale: float | None = None,
                 context: tuple | None = None, grads: tuple = (), delta_in: torch.Tensor | None = None) -> tuple:
        """Gradients (dq, dk, dv) of <do, o>; stats as returned by forward. grads: the fp32 buffers (and strides)
        into which the dK/dV kernels add the modifier tensors' gradients (modifiers.py), zeroed by the caller.
        delta_in: fp32 [B, H, N_Q] added to each row's delta (the row statistic's gradient: runtime.py)."""
        context = self._context(context)
        # no gradient buffers: no modifier tensor asked for a gradient, and the kernels skip their atomic adds
        spec = self.spec if grads else self.spec_without_grads
        batch, hq, hkv, n_q, n_k, head_dim = self.shapes(q, k, v, w)
        value_dim = v.shape[3]
        widths = {"HEAD_DIM": head_tile(head_dim), "D": head_dim, "HEAD_DIM_V": head_tile(value_dim), "DV": value_dim}
        scale = head_dim**-0.5 if scale is None else float(scale)
        z, m = stats
        m_arg = m if self.config.online_max else z
        w_arg, w_strides = weight_arg(w, q)
        precision = self.precision(q.dtype)
        tile = head_tile(head_dim)
        if do.dtype != q.dtype:
            do = do.to(q.dtype)
        sizes = (scale, hq, hkv, hq // hkv, n_q, n_k, bucket(n_q), bucket(n_k), bucket(batch * hq), context, grads)

        delta = self.new((batch, hq, n_q), torch.float32, q.device) if delta_in is None else delta_in.clone()
        # FOLD: the dK/dV side reads the folded statistics (`_fold_rows`): l in place of m, delta * b(z)
        l2 = self.new((batch, hq, n_q), torch.float32, q.device) if self.flags["FOLD"] else m_arg
        dk = self.new(k.shape, k.dtype, k.device)
        dv = self.new(v.shape, v.dtype, v.device)

        def grid_dkdv(meta: dict) -> tuple:
            return grid_order(triton.cdiv(n_k, meta["BLOCK_N"]), batch * hkv, meta)

        def grid_dq(meta: dict) -> tuple:
            return grid_order(triton.cdiv(n_q, meta["BLOCK_M"]), batch * hq, meta)

        def dkdv_kernel(ds: torch.Tensor | None = None, row: int = 0) -> None:
            """dK, dV; with ds, every dS tile is also stored there (rows of length row)."""
            tma = self.tma_ok(q, do)
            bulk = ds is not None and self.config.ds_bulk_store and self.tma_ok(ds)
            ds_arg = dk if ds is None else ds_descriptor(ds, n_q) if bulk else ds
            fast(self.bwd_dkdv_kernel)[grid_dkdv](
                descriptor(q, tma), k, v, w_arg, descriptor(do, tma), z, l2, delta, dk, dv, ds_arg,
                *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(), *w_strides, row,
                *sizes, **widths, PRECISION=precision, TMA=tma, STORE_DS=ds is not None,
                DS_BULK=bulk, **spec,
            )

        if not self.config.deterministic_bwd:
            # fp32 dQ accumulator for the fused kernel, zeroed by the delta kernel
            dq_acc = self.new((batch, hq, n_q, tile), torch.float32, q.device)
            self.delta(o, do, z, delta, dq_acc, head_dim, delta_in is not None, m_arg, l2)
            fast(self.bwd_fused_kernel)[grid_dkdv](
                q, k, v, w_arg, do, z, l2, delta, dk, dv, dq_acc,
                *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(), *w_strides,
                *sizes, **widths, PRECISION=precision, **spec,
            )
            dq = self.new(q.shape, q.dtype, q.device)
            fast(bwd_dq_cast_kernel)[(triton.cdiv(n_q, DELTA_BLOCK_M), batch * hq)](
                dq_acc, dq, *dq.stride(), scale, hq, n_q, HEAD_DIM=tile, D=head_dim, BLOCK_M=DELTA_BLOCK_M,
            )
            return dq, dk, dv

        dq = self.new(q.shape, q.dtype, q.device)
        # rows of the stored dS padded to 8 elements: TMA needs 16-byte aligned strides
        row = -(-n_q // 8) * 8
        ds = None
        # (not with a mask hook that hides pairs: the dQ-from-dS kernel reads every tile of its key range, and the
        # dK/dV kernel writes only those the mask's query ranges reach)
        if batch * hq * n_k * row * q.element_size() <= self.config.ds_buffer_bytes and not self.mask_hides:
            with contextlib.suppress(torch.OutOfMemoryError):  # the buffer only saves work: else recompute
                ds = self.new((batch * hq, n_k, row), q.dtype, q.device)
        if ds is not None:
            # delta first, then dK/dV, which stores dS, then dQ = dS K: 5 products per block pair
            self.delta(o, do, z, delta, delta_in=delta_in is not None, m=m_arg, l2=l2)
            dkdv_kernel(ds, row)
            tma = self.tma_ok(ds, k)
            fast(self.bwd_dq_ds_kernel)[grid_dq](
                ds_descriptor(ds, n_q) if tma else ds, descriptor(k, tma), dq, *k.stride(), *dq.stride(), row,
                scale, hq, hq // hkv, n_q, n_k, *sizes[6:9], HEAD_DIM=tile, D=head_dim, PRECISION=precision,
                TMA=tma, CAUSAL=self.causal,
            )
            return dq, dk, dv

        # dQ first: it computes delta, which the dK/dV kernel reads
        tma = self.tma_ok(k, v)
        fast(self.bwd_dq_kernel)[grid_dq](
            q, descriptor(k, tma), descriptor(v, tma), w_arg, o, do, z, m_arg, l2, delta, dq,
            *q.stride(), *k.stride(), *v.stride(), *o.stride(), *do.stride(), *dq.stride(), *w_strides,
            scale, hq, hq // hkv, n_q, n_k, *sizes[6:], **widths, PRECISION=precision, TMA=tma,
            DELTA_IN=delta_in is not None, **spec,
        )
        dkdv_kernel()
        return dq, dk, dv

    def delta(self, o: torch.Tensor, do: torch.Tensor, z: torch.Tensor, delta: torch.Tensor,
              dq_acc: torch.Tensor | None = None, head_dim: int | None = None, delta_in: bool = False,
              m: torch.Tensor | None = None, l2: torch.Tensor | None = None) -> None:
        """delta (o, do: [B, H, N, DV]), added to what `delta` holds with delta_in, and the fp32 dQ accumulator
        [B, H, N, head_tile(head_dim)] zeroed when one is given (head_dim: q's width; None: o's). With FOLD and l2
        given, the folded statistics for the dK/dV kernels (FOLD): delta * b(z) into delta, l from m into l2."""
        batch, hq, n_q, value_dim = o.shape
        head_dim = value_dim if head_dim is None else head_dim
        fold = self.flags["FOLD"] and l2 is not None
        fast(bwd_delta_kernel)[(triton.cdiv(n_q, DELTA_BLOCK_M), batch * hq)](
            o, do, z, m if fold else z, l2 if fold else z, delta, delta if dq_acc is None else dq_acc,
            *o.stride(), *do.stride(), hq, n_q,
            HEAD_DIM=head_tile(head_dim), D=head_dim, HEAD_DIM_V=head_tile(value_dim), DV=value_dim,
            BLOCK_M=DELTA_BLOCK_M, ZERO_DQ=dq_acc is not None, B=self.maps["B"], DB_OVER_B=self.maps["DB_OVER_B"],
            DELTA_IN=delta_in, FOLD=fold, EXP2=self.flags["EXP2"],
        )

    def weight_gradient(self, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor,
                        o: torch.Tensor, z: torch.Tensor, m: torch.Tensor | None, scale: float | None,
                        context: tuple | None = None) -> torch.Tensor:
        """dL/dw [B, Nk] float32 for the per-key weight, from the saved statistics of either form (m: None without
        the running max)."""
        context = self._context(context)
        batch, hq, hkv, n_q, n_k, head_dim = self.shapes(q, k, v, w)
        scale = head_dim**-0.5 if scale is None else float(scale)
        if do.dtype != q.dtype:
            do = do.to(q.dtype)
        delta = self.new((batch, hq, n_q), torch.float32, q.device)
        self.delta(o, do, z, delta)
        dw = self.new((batch, hkv, n_k), torch.float32, q.device)
        block = 16 if _INTERPRET else 64
        bwd_dw_kernel[(triton.cdiv(n_k, block), batch * hkv)](
            q, k, v, do, z, m if m is not None else z, delta, dw,
            *q.stride(), *k.stride(), *v.stride(), *do.stride(),
            scale, hq, hkv, hq // hkv, n_q, n_k, context,
            HEAD_DIM=head_tile(head_dim), D=head_dim, HEAD_DIM_V=head_tile(v.shape[3]), DV=v.shape[3],
            PRECISION=self.precision(q.dtype), BLOCK_M=block, BLOCK_N=block, num_warps=4, **self.spec,
        )
        return dw.sum(1)

    def backward_from_saved(self, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            w: torch.Tensor | None, o: torch.Tensor, z: torch.Tensor, m: torch.Tensor | None,
                            scale: float | None, context: tuple | None = None, grads: tuple = (),
                            delta_in: torch.Tensor | None = None) -> tuple:
        """backward() from the tensors `save_for_backward` keeps (m: None, or empty, without the online max)."""
        return self.ns["backward"](do, q, k, v, o, (z, m if self.config.online_max else None), w, scale, context,
                                   grads, delta_in)

    def saved_backward(self, ctx: Any, do: torch.Tensor, run: Callable | None = None) -> tuple:
        """Gradients of (q, k, v, w, scale): w's where it needs one (`weight_gradient`); the scale gets none here
        (the op routes a tensor scale's gradient through q)."""
        dq, dk, dv = (run or self.ns["backward_from_saved"])(do, *ctx.saved_tensors, ctx.scale)
        dw = None
        if self.has_weight and ctx.needs_input_grad[3]:
            q, k, v, w, o, z, *rest = ctx.saved_tensors
            dw = self.weight_gradient(do, q, k, v, w, o, z, rest[0] if self.config.online_max else None, ctx.scale)
        return dq, dk, dv, dw, None

    def autograd_function(self, forward: str = "forward", backward: str = "backward_from_saved") -> type:
        """A torch.autograd.Function over the generated module's `forward` and `backward` functions (by name):
        `.apply(q, k, v, w, scale)`; w (if any) gets its gradient where it needs one."""
        kernels = self

        class Attention(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor | None = None,
                        scale: float | None = None) -> torch.Tensor:
                o, stats = kernels.ns[forward](q, k, v, w, scale)
                save_for_backward(ctx, (q, k, v, w, scale), (o, *stats))
                return o

            @staticmethod
            def backward(ctx: Any, do: torch.Tensor) -> tuple:  # type: ignore[override]
                if torch.is_grad_enabled():  # create_graph=True: the kernels' gradients are not differentiable
                    raise RuntimeError(f"{kernels.name}: double backward (create_graph=True) is not supported; the "
                                       "attention kernels' gradients are not differentiable")
                return kernels.saved_backward(ctx, do, kernels.ns[backward])

        return Attention
