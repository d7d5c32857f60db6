"""Call-time range tables of a tensor mask, for block sparsity (FlexAttention's BlockMask, per row).

A mask over integer tensors (document masking `q_doc == k_doc and key <= query`) has no visible interval at compile
time (mask_ranges.py), so its KEY_RANGE / QUERY_RANGE hooks (modifiers.py) can only give a conservative outer bound
and no full blocks: every block below the causal diagonal runs masked. Once the tensors are known, one pass over
the mask finds the exact ranges:

    rows table [B', H', N_Q, 4]: per query row i  (lo, full_lo, full_hi, hi)
    cols table [B', H', N_K, 4]: per key column j  the same for the queries that see j

int32, where lo / hi are the first visible position and the last one + 1 (lo = hi = 0 when none is visible), and
[full_lo, full_hi) is [lo, hi) when every position in it is visible (the visible set is one interval), else empty
(full_lo = full_hi = lo: conservative, those blocks run masked). B' (H') is 1 when neither the mask nor its outer
bound reads the batch (head) position: the caller says so, and the kernels then read the table with stride 0 there.

`row_ranges` / `col_ranges` build the tables with a Triton kernel (portable `tl`, runs under TRITON_INTERPRET=1)
that evaluates the generated MASK hook tile by tile: a program owns a block of rows and loops over the blocks of
keys (of queries, for the cols table) inside the compile-time outer bound, so the work is one mask evaluation per
(row, position) pair inside that bound (half the square for causal masks) and no [N_Q, N_K] tensor is formed.
Given the table of the other direction, a scan also skips the positions whose own range misses the block (the
cols table built after the rows table scans, for document masks, only the block's documents). The results are
cached (a few entries, LRU) per mask tensor: repeated calls with the same tensors (the same storage, unchanged
since: `tensor._version`), scalars and sizes return the same table, as one BlockMask serves every layer; not
during a CUDA-graph capture, where the table's kernel is captured so that each replay rebuilds it.

`table_range` is the device function a generated KEY_RANGE / QUERY_RANGE hook calls to reduce a table over the
kernel's block of rows; `table_context` gives the (pointer, strides) it reads. `segment_ids_from_cu_seqlens` turns
packed variable-length sequences (cu_seqlens) into the per-token document ids a document-masked spec takes.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from ncd import settings

ROWS, COLS = "rows", "cols"
CACHE_SIZE = 8  # tables kept (LRU): a model's few distinct masks, forward and backward
# (positions per program, positions per scanned tile): each scan step evaluates BLOCK_OWN x BLOCK_SCAN mask pairs
GPU_BLOCKS = (64, 128)
INTERPRETER_BLOCKS = (16, 32)


# ---------------------------------------------------------------------------------------------------------------
# Device code
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _no_bound(rows, b, h, C):
    """The outer bound of a call that passes none: every position (the scan clips to [0, N))."""
    zero = tl.min(rows, 0) * 0
    return zero, zero, zero, zero + 2147483647


@triton.jit
def _range_kernel(
    OUT, stride_ob, stride_oh, stride_on,
    OTHER, stride_xb, stride_xh, stride_xn,
    N_OWN, N_SCAN, C,
    MASK: tl.constexpr, OUTER: tl.constexpr, BY_COLS: tl.constexpr, HAS_OTHER: tl.constexpr,
    BLOCK_OWN: tl.constexpr, BLOCK_SCAN: tl.constexpr,
):
    """One program: BLOCK_OWN positions of the owned axis (query rows, or key columns when BY_COLS) of one (b, h);
    it scans the other axis in tiles of BLOCK_SCAN inside OUTER's bound for the block and writes each position's
    (lo, full_lo, full_hi, hi). HAS_OTHER: OTHER is the table of the other direction (strides 0 where it has one
    batch or head); the scan then also stays inside the scanned positions whose range meets the block."""
    off_b = tl.program_id(1)
    off_h = tl.program_id(2)
    own = tl.program_id(0) * BLOCK_OWN + tl.arange(0, BLOCK_OWN)
    in_own = own < N_OWN
    outer_lo, _, _, outer_hi = OUTER(own, off_b, off_h, C)
    start = tl.maximum(outer_lo, 0) // BLOCK_SCAN * BLOCK_SCAN
    end = tl.minimum(outer_hi, N_SCAN)
    if HAS_OTHER:  # a position sees some of the block only if its own [lo, hi) meets the block: O(N_SCAN) loads
        own_lo = tl.program_id(0) * BLOCK_OWN
        own_hi = tl.minimum(own_lo + BLOCK_OWN, N_OWN)
        other = OTHER + off_b.to(tl.int64) * stride_xb + off_h.to(tl.int64) * stride_xh
        hit_lo = start * 0 + N_SCAN
        hit_hi = start * 0
        for s in range(start, end, BLOCK_SCAN):
            scan = s + tl.arange(0, BLOCK_SCAN)
            ok = scan < end
            lo_s = tl.load(other + scan.to(tl.int64) * stride_xn, mask=ok, other=0)
            hi_s = tl.load(other + scan.to(tl.int64) * stride_xn + 3, mask=ok, other=0)
            hit = ok & (lo_s < own_hi) & (hi_s > own_lo)  # a position that sees nothing stores (0, 0): no hit
            hit_lo = tl.minimum(hit_lo, tl.min(tl.where(hit, scan, N_SCAN), 0))
            hit_hi = tl.maximum(hit_hi, tl.max(tl.where(hit, scan + 1, 0), 0))
        start = tl.maximum(start, hit_lo // BLOCK_SCAN * BLOCK_SCAN)
        end = tl.minimum(end, hit_hi)
    first = tl.full([BLOCK_OWN], N_SCAN, tl.int32)
    last = tl.zeros([BLOCK_OWN], tl.int32)  # last visible + 1
    count = tl.zeros([BLOCK_OWN], tl.int32)
    for s in range(start, end, BLOCK_SCAN):
        scan = s + tl.arange(0, BLOCK_SCAN)
        in_scan = scan < N_SCAN
        if BY_COLS:  # tiles [scan queries, own keys], reduced over the queries
            visible = MASK(scan[:, None], own[None, :], off_b, off_h, C) & in_scan[:, None] & in_own[None, :]
            first = tl.minimum(first, tl.min(tl.where(visible, scan[:, None], N_SCAN), 0))
            last = tl.maximum(last, tl.max(tl.where(visible, scan[:, None] + 1, 0), 0))
            count += tl.sum(visible.to(tl.int32), 0)
        else:  # tiles [own queries, scan keys], reduced over the keys
            visible = MASK(own[:, None], scan[None, :], off_b, off_h, C) & in_own[:, None] & in_scan[None, :]
            first = tl.minimum(first, tl.min(tl.where(visible, scan[None, :], N_SCAN), 1))
            last = tl.maximum(last, tl.max(tl.where(visible, scan[None, :] + 1, 0), 1))
            count += tl.sum(visible.to(tl.int32), 1)
    seen = count > 0
    lo = tl.where(seen, first, 0)
    hi = tl.where(seen, last, 0)
    whole = seen & (count == hi - lo)  # no gap inside [lo, hi)
    full_hi = tl.where(whole, hi, lo)
    base = OUT + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh + own.to(tl.int64) * stride_on
    tl.store(base, lo, mask=in_own)
    tl.store(base + 1, lo, mask=in_own)
    tl.store(base + 2, full_hi, mask=in_own)
    tl.store(base + 3, hi, mask=in_own)


@triton.jit
def table_range(T, stride_b, stride_h, stride_n, rows, n, b, h):
    """(lo, full_lo, full_hi, hi) of a block of rows from a range table (`row_ranges` / `col_ranges`, through
    `table_context`): the block sees no position outside [lo, hi) (the union of its rows' ranges) and every
    position in [full_lo, full_hi) (those visible to every row of the block). rows: the block's positions along the
    table's axis (a vector; those >= n are ignored); b, h: the batch and query head (0 where the table has one).

    A row that sees nothing adds nothing to [lo, hi) and empties the full range (running a block unmasked would
    show it keys). The full range is the intersection of the rows' full ranges; when empty it is returned as
    [lo, lo). With no visible position at all: (0, 0, 0, 0)."""
    valid = rows < n
    base = T + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h + rows.to(tl.int64) * stride_n
    row_lo = tl.load(base, mask=valid, other=0)
    row_full_lo = tl.load(base + 1, mask=valid, other=0)
    row_full_hi = tl.load(base + 2, mask=valid, other=0)
    row_hi = tl.load(base + 3, mask=valid, other=0)
    seen = valid & (row_hi > row_lo)
    any_seen = tl.max(seen.to(tl.int32), 0) > 0
    lo = tl.where(any_seen, tl.min(tl.where(seen, row_lo, 2147483647), 0), 0)
    hi = tl.max(tl.where(seen, row_hi, 0), 0)
    # an empty row range [x, x) (a row that sees nothing stores (0, 0, 0, 0)) pulls full_lo >= x >= full_hi: empty
    full_lo = tl.max(tl.where(valid, row_full_lo, 0), 0)
    full_hi = tl.min(tl.where(valid, row_full_hi, 2147483647), 0)
    empty = full_hi <= full_lo
    full_lo = tl.where(empty, lo, full_lo)
    full_hi = tl.where(empty, lo, full_hi)
    return lo, full_lo, full_hi, hi


# ---------------------------------------------------------------------------------------------------------------
# Host code
# ---------------------------------------------------------------------------------------------------------------


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@torch.compiler.disable  # runs eagerly under torch.compile: the cache reads pointers and versions of real tensors
def row_ranges(mask: Any, context: Sequence[Any], n_q: int, n_k: int, batch: int, heads: int, *,
               by_batch: bool = True, by_head: bool = True, outer: Any = None, cols: torch.Tensor | None = None,
               device: torch.device | str | None = None, cache: bool = True) -> torch.Tensor:
    """The rows table: int32 [B', H', n_q, 4], per query row i (lo, full_lo, full_hi, hi) of the keys it sees.

    mask: the generated MASK hook, `@triton.jit def MASK(i, j, b, h, C) -> visible` (i a [BM, 1] tile of query
    positions, j a [1, BN] tile of keys; modifiers.py). context: its context tuple C, passed to it as is (C[0] = N_Q,
    C[1] = N_K, then the tensors' pointers and strides, scalars, sizes: runtime.py `_context`; without the tables
    themselves, or every call is a new key). batch, heads: the call's batch size and query heads; by_batch /
    by_head: whether the mask (or `outer`) reads b / h (False gives B' = 1 / H' = 1 and evaluates with b = 0 /
    h = 0). outer: a compile-time KEY_RANGE hook (an exact or conservative bound, `(rows, b, h, C) -> (lo, _, _,
    hi)`, never one that reads this table); the scan visits only the keys inside it (keys <= i for causal masks:
    half the work). cols: the cols table of the same mask, if built already: the scan then also skips keys whose
    queries miss the block (for document masks, everything outside the block's documents). device: where the
    table lives (default: that of the first tensor in C, else the CPU). cache: reuse a table built for the same
    hook, tensors (same storage, pointer, shape, strides and dtype, `_version` unchanged), scalars and sizes
    (`clear_cache` empties it; inference tensors, which keep no version, are never cached). A cached table is
    shared: read it, never write to it."""
    return _ranges(ROWS, mask, context, n_q, n_k, batch, heads, by_batch, by_head, outer, cols, device, cache)


@torch.compiler.disable
def col_ranges(mask: Any, context: Sequence[Any], n_q: int, n_k: int, batch: int, heads: int, *,
               by_batch: bool = True, by_head: bool = True, outer: Any = None, rows: torch.Tensor | None = None,
               device: torch.device | str | None = None, cache: bool = True) -> torch.Tensor:
    """The cols table: int32 [B', H', n_k, 4], per key column j (lo, full_lo, full_hi, hi) of the queries that see
    it, for the backward's dK/dV programs. Arguments as `row_ranges`; outer: a compile-time QUERY_RANGE hook; rows:
    the rows table (`row_ranges` with the same arguments), which bounds the scan to the queries whose keys meet
    the block of columns: for documents of length L, about L / 2 queries per key instead of N / 2."""
    return _ranges(COLS, mask, context, n_q, n_k, batch, heads, by_batch, by_head, outer, rows, device, cache)


def table_context(table: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """(table, stride_b, stride_h, stride_n) for `table_range`: stride 0 over a batch or head dimension of size 1,
    so the kernels pass their own b and h whatever the table's B', H'."""
    stride_b, stride_h, stride_n, _ = table.stride()
    return (table, 0 if table.shape[0] == 1 else stride_b, 0 if table.shape[1] == 1 else stride_h, stride_n)


def segment_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Per-token document ids int32 [total] of packed variable-length sequences, for a document-masked spec.

    cu_seqlens: int32 or int64 [n_seq + 1], nondecreasing, cu_seqlens[0] = 0 (the flash-attn / fla convention:
    sequence s holds the tokens [cu_seqlens[s], cu_seqlens[s + 1])); total: the packed length (usually
    cu_seqlens[-1], passed so that no device value is read back). Token t gets the s with cu_seqlens[s] <= t <
    cu_seqlens[s + 1]; empty sequences get no token; tokens at or past cu_seqlens[-1] (padding) get n_seq, a
    document of their own. Example, three sequences of 3, 1 and 2 tokens packed into one row:

        >>> cu = torch.tensor([0, 3, 4, 6], dtype=torch.int32)
        >>> segment_ids_from_cu_seqlens(cu, 6)
        tensor([0, 0, 0, 1, 2, 2], dtype=torch.int32)
        >>> ids = segment_ids_from_cu_seqlens(cu, 6)[None]  # [batch = 1, tokens]
        >>> # o = document_softmax(q, k, v, ids, ids)  with q, k, v [1, heads, 6, dim]

    (specs/document_softmax.ncd masks `q_doc == k_doc and key <= query`: the varlen causal attention of
    flash_attn_varlen_func with cu_seqlens_q = cu_seqlens_k = cu_seqlens.)"""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be one-dimensional [n_seq + 1]; got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.is_floating_point() or cu_seqlens.is_complex() or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"cu_seqlens must hold integers (torch.int32 or torch.int64); got {cu_seqlens.dtype}")
    if total < 0:
        raise ValueError(f"total must be >= 0; got {total}")
    tokens = torch.arange(total, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens[1:].contiguous(), tokens, right=True).to(torch.int32)


def clear_cache() -> None:
    """Forget every cached table."""
    with _LOCK:
        _CACHE.clear()


# --- the cache --------------------------------------------------------------------------------------------------

_CACHE: OrderedDict[tuple, tuple[tuple[weakref.ref, ...], torch.Tensor]] = OrderedDict()  # key -> (storages, table)
_LOCK = threading.Lock()


def _capturing() -> bool:
    """A CUDA graph is being captured: the table's kernel must be launched (captured), not found in the cache, so
    that each replay rebuilds the table from the mask tensors' contents then (a model updates its static inputs in
    place between replays, which no version counter sees)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _fingerprint(context: Sequence[Any]) -> tuple[tuple, tuple[torch.Tensor, ...]] | None:
    """(key, tensors) of a context tuple, or None when it holds something the cache cannot tell apart (an
    inference tensor has no version counter, so an in-place change would go unseen)."""
    parts: list[Any] = []
    tensors = []
    for value in context:
        if isinstance(value, torch.Tensor):
            if value.is_inference():
                return None
            parts.append(("tensor", value.data_ptr(), tuple(value.shape), value.stride(), value.dtype,
                          value.device, value._version))
            tensors.append(value)
        elif isinstance(value, (bool, int, float, str)) or value is None:
            parts.append((type(value).__name__, value))
        else:
            return None
    return tuple(parts), tuple(tensors)


def _lookup(key: tuple, tensors: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
    """The cached table, if its tensors still live in the very same storages (a freed tensor's memory may be reused
    by a new one with the same pointer, shape and version 0: the pointer alone is no identity). Storages, not tensor
    objects: the backward under torch.compile receives its saved tensors as other objects over the same storage."""
    with _LOCK:
        entry = _CACHE.get(key)
        if entry is None:
            return None
        refs, table = entry
        if any(ref() is not t.untyped_storage() for ref, t in zip(refs, tensors, strict=True)):
            del _CACHE[key]
            return None
        _CACHE.move_to_end(key)
        return table


def _store(key: tuple, tensors: tuple[torch.Tensor, ...], table: torch.Tensor) -> None:
    with _LOCK:
        _CACHE[key] = (tuple(weakref.ref(t.untyped_storage()) for t in tensors), table)
        _CACHE.move_to_end(key)
        while len(_CACHE) > CACHE_SIZE:
            _CACHE.popitem(last=False)


# --- building -----------------------------------------------------------------------------------------------------


def _ranges(kind: str, mask: Any, context: Sequence[Any], n_q: int, n_k: int, batch: int, heads: int,
            by_batch: bool, by_head: bool, outer: Any, other: torch.Tensor | None, device: torch.device | str | None,
            cache: bool) -> torch.Tensor:
    context = tuple(context)
    if n_q < 0 or n_k < 0 or batch < 1 or heads < 1:
        raise ValueError(f"sizes must be n_q, n_k >= 0 and batch, heads >= 1; got n_q={n_q}, n_k={n_k}, "
                         f"batch={batch}, heads={heads}")
    dims = (batch if by_batch else 1, heads if by_head else 1)
    if other is not None:
        n_other = n_k if kind == ROWS else n_q
        if other.dtype != torch.int32 or other.shape != (*dims, n_other, 4):
            raise ValueError(f"the {COLS if kind == ROWS else ROWS} table must be int32 {(*dims, n_other, 4)} (built "
                             f"with the same sizes and flags); got {other.dtype} {tuple(other.shape)}")
    if device is None:
        device = next((v.device for v in context if isinstance(v, torch.Tensor)), torch.device("cpu"))
    device = torch.device(device)
    blocks = INTERPRETER_BLOCKS if _interpreting() else GPU_BLOCKS
    fingerprint = _fingerprint(context) if cache and not _capturing() else None
    key = None
    if fingerprint is not None:
        key = (kind, mask, outer, n_q, n_k, dims, str(device), blocks, fingerprint[0])
        found = _lookup(key, fingerprint[1])
        if found is not None:
            return found
    table = _build(kind, mask, context, n_q, n_k, dims, outer, other, device, blocks)
    if key is not None and fingerprint is not None:
        _store(key, fingerprint[1], table)
    return table


def _build(kind: str, mask: Any, context: tuple, n_q: int, n_k: int, dims: tuple[int, int], outer: Any,
           other: torch.Tensor | None, device: torch.device, blocks: tuple[int, int]) -> torch.Tensor:
    n_own, n_scan = (n_q, n_k) if kind == ROWS else (n_k, n_q)
    table = torch.empty((*dims, n_own, 4), dtype=torch.int32, device=device)
    if settings.POISON_OUTPUTS:  # ncd/settings.py: an entry the kernel forgets to store shows up (no NaN in int32)
        table.fill_(-(2**31))
    if n_own == 0:
        return table
    block_own, block_scan = blocks
    other_args = table_context(other) if other is not None else (table, 0, 0, 0)
    _range_kernel[(triton.cdiv(n_own, block_own), *dims)](
        table, *table.stride()[:3], *other_args, n_own, n_scan, context,
        MASK=mask, OUTER=outer if outer is not None else _no_bound, BY_COLS=kind == COLS,
        HAS_OTHER=other is not None, BLOCK_OWN=block_own, BLOCK_SCAN=block_scan,
    )
    return table
