"""Issue 32: call-time range tables of tensor masks (ncd/families/attention/mask_table.py), against brute force over
the dense mask: per row / per column (lo, full_lo, full_hi, hi), the block reduction the kernels' hooks use, the
cache (BlockMask reuse across layers), and document ids from cu_seqlens."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import ncd
from ncd.families.attention import mask_table as mt

from .conftest import ROOT

B, H, N_Q, N_K = 2, 3, 37, 29


def _runs(n: int, lengths: list[int]) -> torch.Tensor:
    """Document ids: sorted runs of the given lengths, cut at n (a last run takes what they leave)."""
    ids = torch.cat([torch.full((length,), d) for d, length in enumerate(lengths)])
    return torch.cat([ids, torch.full((max(n - len(ids), 0),), len(lengths))])[:n].to(torch.int32)


def _expected(dense: torch.Tensor) -> torch.Tensor:
    """The table from the dense mask [..., own, scan]: per own position (lo, full_lo, full_hi, hi)."""
    n_scan = dense.shape[-1]
    pos = torch.arange(n_scan)
    count = dense.sum(-1)
    lo = torch.where(dense, pos, n_scan).amin(-1)
    hi = torch.where(dense, pos + 1, 0).amax(-1)
    lo = torch.where(count > 0, lo, 0)
    full_hi = torch.where((count > 0) & (count == hi - lo), hi, lo)
    return torch.stack([lo, lo, full_hi, hi], -1).to(torch.int32)


def _positions():
    return torch.arange(N_Q)[:, None], torch.arange(N_K)[None, :]


# --- masks written as hooks here (the generated ones' signature: MASK(i, j, b, h, C)) --------------------------


@triton.jit
def _different_document(i, j, b, h, C):
    """q_doc[b, i] != k_doc[b, j]: never one interval of keys (the documents before and after)."""
    kd = tl.load(C[7] + b.to(tl.int64) * C[8] + j * C[9], mask=(j < C[1]), other=0)
    qd = tl.load(C[10] + b.to(tl.int64) * C[11] + i * C[12], mask=(i < C[0]), other=0)
    return qd != kd


@triton.jit
def _two_windows_per_head(i, j, b, h, C):
    """Causal, keys within h + 2 of the query or at least 10 before it: two windows, the near one per head."""
    return (j <= i) & ((i - j < h + 2) | (i - j >= 10))


@triton.jit
def _window_per_head(i, j, b, h, C):
    """A causal sliding window of 8 h + 4 keys."""
    return (j <= i) & (i - j < 8 * h + 4)


@triton.jit
def _padded_document_per_head(i, j, b, h, C):
    """Same document, causal, keys below kv_len[b] and queries below q_len[h]: fully masked rows and columns."""
    kd = tl.load(C[7] + b.to(tl.int64) * C[8] + j * C[9], mask=(j < C[1]), other=0)
    qd = tl.load(C[10] + b.to(tl.int64) * C[11] + i * C[12], mask=(i < C[0]), other=0)
    kv_len = tl.load(C[13] + b.to(tl.int64) * C[14])
    q_len = tl.load(C[15] + h * C[16])
    return (qd == kd) & (j <= i) & (j < kv_len) & (i < q_len)


@triton.jit
def _counted_document(i, j, b, h, C):
    """Same document and causal, adding the number of (i, j) pairs evaluated to the counter C[13]."""
    kd = tl.load(C[7] + b.to(tl.int64) * C[8] + j * C[9], mask=(j < C[1]), other=0)
    qd = tl.load(C[10] + b.to(tl.int64) * C[11] + i * C[12], mask=(i < C[0]), other=0)
    ones = (i + j) * 0 + 1
    tl.atomic_add(C[13], tl.sum(tl.sum(ones, 1), 0))
    return (qd == kd) & (j <= i)


@triton.jit
def _causal_key_range(rows, b, h, C):
    """The causal outer bound of a block of query rows: keys <= the last row."""
    zero = tl.min(rows, 0) * 0
    return zero, zero, zero, tl.max(rows, 0) + 1


@triton.jit
def _causal_query_range(cols, b, h, C):
    """The causal outer bound of a block of key columns: queries >= the first column."""
    first = tl.min(cols, 0)
    return first, first, first, first * 0 + C[0]


def _context(*tensors: torch.Tensor) -> tuple:
    context: list = [N_Q, N_K, 1, 0, 0, N_Q, N_K]  # (runtime.py's base_context: one device's whole sequence)
    for t in tensors:
        context += [t, *t.stride()]
    return tuple(context)


def _documents(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random uneven runs per batch row, one of a single token; the key ids cut differently from the query ids."""
    g = torch.Generator().manual_seed(seed)

    def draw(n: int) -> torch.Tensor:
        lengths = [1, *torch.randint(2, 9, (3,), generator=g).tolist()]  # all inside N_K: one of 1
        return _runs(n, [lengths[k] for k in torch.randperm(4, generator=g).tolist()])

    return torch.stack([draw(N_Q), draw(N_Q)]), torch.stack([draw(N_K), draw(N_K)])


def _check_both(mask, context, dense, by_batch, by_head, outers=(None, None)):
    """Rows and cols tables against brute force, each also built with the other direction's table bounding its
    scan; dense: [B', H', N_Q, N_K]."""
    flags = {"by_batch": by_batch, "by_head": by_head, "cache": False}
    rows = mt.row_ranges(mask, context, N_Q, N_K, B, H, outer=outers[0], **flags)
    cols = mt.col_ranges(mask, context, N_Q, N_K, B, H, outer=outers[1], **flags)
    assert rows.dtype == cols.dtype == torch.int32
    assert torch.equal(rows, _expected(dense))
    assert torch.equal(cols, _expected(dense.transpose(-1, -2)))
    assert torch.equal(mt.col_ranges(mask, context, N_Q, N_K, B, H, outer=outers[1], rows=rows, **flags), cols)
    assert torch.equal(mt.row_ranges(mask, context, N_Q, N_K, B, H, outer=outers[0], cols=cols, **flags), rows)
    return rows, cols


# --- tables -------------------------------------------------------------------------------------------------------


def _document_spec():
    op = ncd.load(ROOT / "specs" / "document_softmax.ncd")
    return op.module


def test_document_causal_tables_from_the_generated_hook_match_brute_force():
    """specs/document_softmax.ncd's MASK hook and context (runtime's layout), scanned inside its compile-time causal
    bounds: every row's keys of its own document up to itself is one interval, so each range is full."""
    module = _document_spec()
    q_doc, k_doc = _documents(0)
    tensors = {"q_doc": q_doc, "k_doc": k_doc}
    context = module._OP.base_context(torch.empty(B, H, N_Q, 1), torch.empty(B, H, N_K, 1),
                                      [tensors[name] for name, _, _ in module._OP.mod_tensors], [])
    i, j = _positions()
    dense = ((q_doc[:, :, None] == k_doc[:, None, :]) & (j <= i))[:, None]
    rows, _ = _check_both(module.MAPS["MASK"], context, dense, True, False,
                          (module._key_bound, module._query_bound))
    seen = rows[..., 3] > rows[..., 0]
    assert seen.any() and (~seen).any()  # rows of a query document no key has see nothing
    assert torch.equal(rows[..., 1:3][seen], rows[..., [0, 3]][seen])  # intervals: full == [lo, hi)
    # without the outer bound the scan covers every key and finds the same
    assert torch.equal(mt.row_ranges(module.MAPS["MASK"], context, N_Q, N_K, B, H, by_head=False, cache=False), rows)


def test_a_mask_that_is_not_an_interval_has_no_full_range_but_exact_bounds():
    q_doc, k_doc = _documents(1)
    dense = (q_doc[:, :, None] != k_doc[:, None, :])[:, None]
    rows, _ = _check_both(_different_document, _context(k_doc, q_doc), dense, True, False)
    gaps = (rows[..., 3] - rows[..., 0]) > dense.sum(-1)
    assert gaps.any()  # some rows see keys on both sides of their document
    assert torch.equal(rows[..., 1][gaps], rows[..., 2][gaps])


def test_two_windows_per_head_with_the_causal_outer_bound():
    i, j = _positions()
    h = torch.arange(H)[:, None, None]
    dense = ((j <= i) & (((i - j) < h + 2) | ((i - j) >= 10)))[None]
    rows, _ = _check_both(_two_windows_per_head, (N_Q, N_K, 1), dense, False, True,
                          (_causal_key_range, _causal_query_range))
    assert rows.shape == (1, H, N_Q, 4)
    assert (rows[..., 2] > rows[..., 1]).any() and (rows[..., 2] == rows[..., 1]).any()


def test_fully_masked_rows_and_columns_and_masks_per_batch_and_head():
    """kv_len = 0 empties every row of batch 1; q_len per head cuts queries: (0, 0, 0, 0) for what sees nothing."""
    q_doc, k_doc = _documents(2)
    kv_len = torch.tensor([N_K - 3, 0], dtype=torch.int32)
    q_len = torch.tensor([N_Q, 11, 1], dtype=torch.int32)
    i, j = _positions()
    dense = ((q_doc[:, None, :, None] == k_doc[:, None, None, :]) & (j <= i) & (j < kv_len[:, None, None, None])
             & (i < q_len[None, :, None, None]))
    rows, cols = _check_both(_padded_document_per_head, _context(k_doc, q_doc, kv_len, q_len), dense, True, True)
    assert rows.shape == (B, H, N_Q, 4) and cols.shape == (B, H, N_K, 4)
    assert torch.equal(rows[1], torch.zeros_like(rows[1]))
    assert torch.equal(rows[0, 2, 1:], torch.zeros_like(rows[0, 2, 1:]))
    no_keys = mt.row_ranges(_two_windows_per_head, (5, 0, 1), 5, 0, B, H, by_batch=False, by_head=False, cache=False)
    assert torch.equal(no_keys, torch.zeros(1, 1, 5, 4, dtype=torch.int32))


def test_the_scan_visits_only_pairs_inside_the_outer_bound_and_the_other_table():
    """Mask evaluations, counted by the hook: the causal outer bound halves them (up to the tiles the diagonal
    cuts), and the rows table bounds the cols scan to each key block's document (documents of 16 tokens)."""
    n, doc, (block_own, block_scan) = 96, 16, mt.INTERPRETER_BLOCKS
    ids = (torch.arange(n) // doc).to(torch.int32)[None].expand(B, n)
    counter = torch.zeros(1, dtype=torch.int32)
    context = (n, n, 1, 0, 0, n, n, ids, *ids.stride(), ids, *ids.stride(), counter)

    def evaluations(build, **kwargs) -> tuple[int, torch.Tensor]:
        counter.zero_()
        table = build(_counted_document, context, n, n, B, H, by_head=False, cache=False, **kwargs)
        return int(counter.item()), table

    def tiles(start: int, end: int) -> int:  # scan tiles from start's tile up to end
        return -(-(end - start // block_scan * block_scan) // block_scan)

    tile = B * block_own * block_scan
    blocks = range(0, n, block_own)
    everything, rows = evaluations(mt.row_ranges)
    assert everything == B * n * n
    causal, causal_rows = evaluations(mt.row_ranges, outer=_causal_key_range)
    assert causal == tile * sum(tiles(0, min(p + block_own, n)) for p in blocks) < everything
    cols_causal, cols = evaluations(mt.col_ranges, outer=_causal_query_range)
    assert cols_causal == tile * sum(tiles(p, n) for p in blocks)
    cols_bounded, cols_by_rows = evaluations(mt.col_ranges, outer=_causal_query_range, rows=rows)
    last_query = [min((p // doc + 1) * doc, n) if block_own <= doc else n for p in blocks]
    assert cols_bounded == tile * sum(tiles(p, e) for p, e in zip(blocks, last_query, strict=True))
    assert cols_bounded <= cols_causal / 2
    assert torch.equal(causal_rows, rows) and torch.equal(cols_by_rows, cols)


# --- the block reduction ------------------------------------------------------------------------------------------


@triton.jit
def _reduce_blocks(OUT, T, stride_b, stride_h, stride_n, N, BLOCK: tl.constexpr):
    """table_range over each block of BLOCK positions of each (b, h), as a KEY_RANGE hook would call it."""
    blk = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    rows = blk * BLOCK + tl.arange(0, BLOCK)
    lo, full_lo, full_hi, hi = mt.table_range(T, stride_b, stride_h, stride_n, rows, N, b, h)
    out = OUT + ((b * tl.num_programs(2) + h) * tl.num_programs(0) + blk) * 4
    tl.store(out, lo)
    tl.store(out + 1, full_lo)
    tl.store(out + 2, full_hi)
    tl.store(out + 3, hi)


def _reduce(table: torch.Tensor, n: int, block: int) -> torch.Tensor:
    blocks = triton.cdiv(n, block)
    out = torch.full((B, H, blocks, 4), -1, dtype=torch.int32)
    _reduce_blocks[(blocks, B, H)](out, *mt.table_context(table), n, BLOCK=block)
    return out


@pytest.mark.parametrize("block", [16])  # the interpreter's attention tile
def test_the_block_reduction_bounds_what_any_row_sees_and_runs_unmasked_only_what_every_row_sees(block):
    """Per block of rows (the last one partly past N): [lo, hi) is the tightest range holding every key a row sees,
    and every key in [full_lo, full_hi) is seen by every row; it is exactly the keys all rows see when each row's
    visible set is an interval, and empty otherwise. A table of H' = 1 is read with stride 0 by every head."""
    q_doc, k_doc = _documents(3)
    kv_len = torch.tensor([N_K - 3, N_K], dtype=torch.int32)
    q_len = torch.tensor([N_Q, 30, 4], dtype=torch.int32)
    i, j = _positions()
    doc = (q_doc[:, None, :, None] == k_doc[:, None, None, :]) & (j <= i)
    cases = [
        ("interval", _padded_document_per_head, _context(k_doc, q_doc, kv_len, q_len),
         doc & (j < kv_len[:, None, None, None]) & (i < q_len[None, :, None, None]), True),
        ("interval", _window_per_head, (N_Q, N_K, 1),
         ((j <= i) & (i - j < 8 * torch.arange(H)[:, None, None] + 4)).expand(B, H, N_Q, N_K), True),
        ("gaps", _different_document, _context(k_doc, q_doc),
         (q_doc[:, :, None] != k_doc[:, None, :])[:, None].expand(B, H, N_Q, N_K), False),
    ]
    some_full, some_gap = {"interval": False, "gaps": False}, {"interval": False, "gaps": False}
    for name, mask, context, dense, by_head in cases:
        table = mt.row_ranges(mask, context, N_Q, N_K, B, H, by_head=by_head, cache=False)
        got = _reduce(table, N_Q, block)
        rows_interval = (_expected(dense)[..., 2] - _expected(dense)[..., 1]) == dense.sum(-1)
        for start in range(0, N_Q, block):
            part = dense[:, :, start:start + block]  # only rows < N_Q
            lo, full_lo, full_hi, hi = got[:, :, start // block].unbind(-1)
            any_seen, every_seen = part.any(2), part.all(2)
            keys = torch.arange(N_K)
            want_lo = torch.where(any_seen, keys, N_K).amin(-1)
            want_hi = torch.where(any_seen, keys + 1, 0).amax(-1)
            nothing = ~any_seen.any(-1)
            assert torch.equal(lo, torch.where(nothing, 0, want_lo)), name
            assert torch.equal(hi, torch.where(nothing, 0, want_hi)), name
            assert (full_hi >= full_lo).all(), name
            in_full = (keys >= full_lo[..., None]) & (keys < full_hi[..., None])
            assert not (in_full & ~every_seen).any(), name  # never unmasked where some row does not see
            exact = rows_interval[:, :, start:start + block].all(-1)
            assert torch.equal(in_full[exact], every_seen[exact]), name
            gap = ~exact  # a row that skips keys in its range: the block has no full range (conservative)
            assert (full_hi[gap] == full_lo[gap]).all(), name
            some_full[name] |= bool((full_hi > full_lo).any())
            some_gap[name] |= bool(gap.any())
    assert some_full["interval"] and some_gap == {"interval": False, "gaps": True}


# --- the tables in the attention kernels --------------------------------------------------------------------------

# hooks as the generated ones will read the tables: C = (the spec's context, rows table, cols table)
@triton.jit
def _table_key_range(rows, b, h, C):
    return mt.table_range(C[13], C[14], C[15], C[16], rows, C[0], b, h)


@triton.jit
def _table_query_range(cols, b, h, C):
    return mt.table_range(C[17], C[18], C[19], C[20], cols, C[1], b, h)


DOCUMENT_16 = """\
spec document16
axis batch, head, query, key
axis dim = 16
in  Q[batch head query dim] : f32
in  K[batch head key dim]   : f32
in  V[batch head key dim]   : f32
in  q_doc[batch query]      : i32
in  k_doc[batch key]        : i32
S[batch head query key] = (Q . K over dim) / 4
A[batch head query key] = normalize(S, over key, a1(x) = exp(x), a2(x) = exp(x), b(z) = z,
                                    mask = q_doc == k_doc and key <= query)
out O[batch head query dim] = A . V over key
"""


def test_document_attention_through_table_hooks_skips_other_documents_and_matches_the_op(tmp_path):
    """The static kernels with KEY_RANGE / QUERY_RANGE reading the tables: the same outputs and gradients as the
    generated op (which masks every block below the diagonal), and NaN in one document's keys and values (or
    queries) reaches no row (no key gradient) of documents whose blocks hold none of it: those blocks are skipped,
    where a visited block, even masked, spreads NaN (0 * NaN; the op's own hooks do)."""
    from ncd.families.attention import kernel

    path = tmp_path / "document16.ncd"
    path.write_text(DOCUMENT_16)
    op = ncd.load(path)
    module = op.module
    maps = {**module.MAPS, "KEY_RANGE": _table_key_range, "QUERY_RANGE": _table_query_range}
    n = 64
    ids = torch.tensor([[0] * 16 + [1] * 24 + [2] * 24], dtype=torch.int32)
    g = torch.Generator().manual_seed(7)
    q, k, v, do = (torch.randn(1, 1, n, 16, generator=g) for _ in range(4))
    base = module._OP.base_context(q, k, [ids, ids], [])  # (k_doc, q_doc): the same ids
    rows = mt.row_ranges(module.MAPS["MASK"], base, n, n, 1, 1, outer=module._key_bound)
    cols = mt.col_ranges(module.MAPS["MASK"], base, n, n, 1, 1, outer=module._query_bound, rows=rows)
    context = (*base, *mt.table_context(rows), *mt.table_context(cols))

    def run(maps, q, k, v, context, backward=True):
        kernels = kernel.AttentionKernels("tables", module.CONFIG, maps, dict(vars(module)), causal=False,
                                          has_weight=False, has_mask=True)
        o, stats = kernels.forward(q, k, v, None, 0.25, context)
        return (o, *kernels.backward(do, q, k, v, o, stats, None, 0.25, context)) if backward else (o,)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want_o = op(*leaves, ids, ids)
    want = (want_o, *torch.autograd.grad(want_o, leaves, do))
    got = run(maps, q, k, v, context)
    for name, a, e in zip(("o", "dq", "dk", "dv"), got, want, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5, msg=name)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, :16] = v2[:, :, :16] = float("nan")  # document 0's keys
    (o,) = run(maps, q, k2, v2, context, backward=False)
    assert o[:, :, :16].isnan().all() and not o[:, :, 32:].isnan().any()  # query blocks 32.. never read keys 0..15
    bounds = {**module.MAPS, "KEY_RANGE": module._key_bound, "QUERY_RANGE": module._query_bound}
    (o,) = run(bounds, q, k2, v2, base, backward=False)
    assert o[:, :, 32:].isnan().any()  # the compile-time causal bound visits them
    o = op(q, k2, v2, ids, ids)  # the op builds and reads the tables itself
    assert o[:, :, :16].isnan().all() and not o[:, :, 32:].isnan().any()
    q2 = q.clone()
    q2[:, :, 48:] = float("nan")  # document 2's last queries
    _, _, dk, dv = run(maps, q2, k, v, context)
    assert dk[:, :, 40:].isnan().all() and not dk[:, :, :32].isnan().any() and not dv[:, :, :32].isnan().any()


# --- the cache ----------------------------------------------------------------------------------------------------


def test_the_cache_reuses_a_table_until_the_mask_tensor_changes():
    """The same tensors (or a detached alias: the same storage) give the same table object, as a BlockMask serves
    every layer; an in-place change (tensor._version), a new tensor of equal contents, or other memory at the same
address recompute."""
    mt.clear_cache()
    module = _document_spec()
    mask, outer = module.MAPS["MASK"], module._key_bound
    q_doc, k_doc = _documents(4)
    i, j = _positions()

    def rows(q, k):
        return mt.row_ranges(mask, _context(k, q), N_Q, N_K, B, H, by_head=False, outer=outer)

    first = rows(q_doc, k_doc)
    assert rows(q_doc, k_doc) is first
    assert rows(q_doc.detach(), k_doc) is first
    assert mt.col_ranges(mask, _context(k_doc, q_doc), N_Q, N_K, B, H, by_head=False) is not first
    assert rows(q_doc.clone(), k_doc) is not first
    # memory reused by another tensor (same pointer, shape, strides, version 0, new contents): not the same storage
    memory = q_doc.numpy().copy()
    before = torch.from_numpy(memory)
    cached = rows(before, k_doc)
    memory[0, :] = 0  # one document: what a new tensor at the freed address could hold
    after = torch.from_numpy(memory)
    assert after.data_ptr() == before.data_ptr() and after._version == before._version == 0
    assert rows(after, k_doc) is not cached
    q_doc[0, 8:14] = 17  # in place: a document of its own
    changed = rows(q_doc, k_doc)
    assert changed is not first
    dense = ((q_doc[:, :, None] == k_doc[:, None, :]) & (j <= i))[:, None]
    assert torch.equal(changed, _expected(dense)) and not torch.equal(changed, first)
    assert rows(q_doc, k_doc) is changed
    with torch.inference_mode():  # no version counter: never cached, still right
        q_inf, k_inf = q_doc.clone(), k_doc.clone()
        assert rows(q_inf, k_inf) is not rows(q_inf, k_inf)
        assert torch.equal(rows(q_inf, k_inf), changed)
    for n in range(mt.CACHE_SIZE):  # bounded: the least recently used goes first
        mt.row_ranges(_two_windows_per_head, (N_Q, N_K, 1, n), N_Q, N_K, B, H, by_batch=False, by_head=False)
    assert len(mt._CACHE) == mt.CACHE_SIZE
    assert rows(q_doc, k_doc) is not changed
    mt.clear_cache()


def test_a_cuda_graph_capture_builds_the_table_instead_of_finding_it_cached(monkeypatch):
    """Under CUDA-graph capture the table's kernel must be launched, so that every replay rebuilds it from the mask
    tensors' contents then: a model copies new document ids into its static inputs in place between replays, and a
    cached table would silently keep the captured documents."""
    mt.clear_cache()
    module = _document_spec()
    mask, outer = module.MAPS["MASK"], module._key_bound
    q_doc, k_doc = _documents(4)

    def rows():
        return mt.row_ranges(mask, _context(k_doc, q_doc), N_Q, N_K, B, H, by_head=False, outer=outer)

    warm = rows()
    assert rows() is warm
    monkeypatch.setattr(mt, "_capturing", lambda: True)
    captured = rows()
    assert captured is not warm and torch.equal(captured, warm)
    assert rows() is not captured  # nor stored while capturing
    monkeypatch.setattr(mt, "_capturing", lambda: False)
    assert rows() is warm
    mt.clear_cache()


def test_tables_are_built_eagerly_and_cached_under_torch_compile():
    """torch.compile runs the host functions eagerly (a graph break): real pointers and versions, one cache entry
    for repeated calls, the same table as an eager call."""
    mt.clear_cache()
    q_doc, k_doc = _documents(6)
    kv_len, q_len = torch.tensor([N_K, 5], dtype=torch.int32), torch.full((H,), N_Q, dtype=torch.int32)
    i, j = _positions()

    def keys_seen(q, k):
        table = mt.row_ranges(_padded_document_per_head, _context(k, q, kv_len, q_len), N_Q, N_K, B, H)
        return table[..., 3] - table[..., 0]

    compiled = torch.compile(keys_seen, backend="eager")
    first = compiled(q_doc, k_doc)
    assert torch.equal(compiled(q_doc, k_doc), first) and len(mt._CACHE) == 1
    dense = (q_doc[:, None, :, None] == k_doc[:, None, None, :]) & (j <= i) & (j < kv_len[:, None, None, None])
    want = _expected(dense.expand(B, H, N_Q, N_K))
    assert torch.equal(first, want[..., 3] - want[..., 0])
    mt.clear_cache()


# --- cu_seqlens ---------------------------------------------------------------------------------------------------


def test_segment_ids_from_cu_seqlens():
    """Token t belongs to the s with cu[s] <= t < cu[s + 1]; empty sequences own no token; padding past cu[-1] is a
    document of its own."""
    cu = torch.tensor([0, 3, 4, 4, 9, 10], dtype=torch.int64)
    got = mt.segment_ids_from_cu_seqlens(cu, 13)
    want = [next((s for s in range(len(cu) - 1) if cu[s] <= t < cu[s + 1]), len(cu) - 1) for t in range(13)]
    assert got.dtype == torch.int32 and got.tolist() == want
    assert mt.segment_ids_from_cu_seqlens(cu.to(torch.int32), 10).tolist() == want[:10]
    assert mt.segment_ids_from_cu_seqlens(cu, 0).shape == (0,)
    with pytest.raises(ValueError, match="integers"):
        mt.segment_ids_from_cu_seqlens(cu.float(), 10)
    with pytest.raises(ValueError, match="one-dimensional"):
        mt.segment_ids_from_cu_seqlens(cu[None], 10)


def test_cu_seqlens_ids_drive_the_document_spec_as_varlen_causal_attention():
    """The docstring's use: packed sequences through specs/document_softmax.ncd equal causal softmax attention run
    on each sequence alone."""
    op = ncd.load(ROOT / "specs" / "document_softmax.ncd")
    cu = torch.tensor([0, 5, 6, 13], dtype=torch.int32)
    ids = mt.segment_ids_from_cu_seqlens(cu, 13)[None]
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 13, 128, generator=g) for _ in range(3))
    out = op(q, k, v, ids, ids)
    for s in range(3):
        a, e = int(cu[s]), int(cu[s + 1])
        want = torch.nn.functional.scaled_dot_product_attention(q[:, :, a:e], k[:, :, a:e], v[:, :, a:e],
                                                                is_causal=True)
        torch.testing.assert_close(out[:, :, a:e], want, rtol=1e-5, atol=1e-5)
