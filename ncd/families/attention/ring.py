"""Context-parallel attention: a ring over torch.distributed, derived from the streamability certificate.

Each rank holds a shard of the query and key axes. Key/value shards travel around the ring (rank r sends to r + 1 and
receives from r - 1); at step s rank r holds the shard of rank r - s and runs the ordinary streamed forward of its
queries against it, a partial state (o_s, z_s, m_s) over those keys. Partial states over disjoint keys combine by the
certificate's merge (`merge_kernel`, the combine of split-K decoding written for finished rows):

    m' = max(m, m_s),  z' = z a2(m - m') + z_s a2(m_s - m'),  o' = (o b(z) a1(m - m') + o_s b(z_s) a1(m_s - m')) / b(z')

(plain sums of z and of o b(z) without the running max), so every normaliser the family accepts runs on the ring.
The backward needs no merge: the gradient of a key shard is the ordinary backward of the queries against it, given
the rows' final (o, z, m). The ring turns the other way, from the forward's last shard to the rank's own keys; the
shard travels with an fp32 dK/dV accumulator that each rank adds its part to, and it arrives home while the owner
runs its own keys.

Causal specs use the zigzag layout: with P ranks the sequence is cut into 2P equal chunks and rank r holds chunks r
and 2P - 1 - r, concatenated (`zigzag_shard`). Then every step costs the same: step 0 is the causal kernel on the
rank's own shard; a shard from an earlier rank is seen whole by all the rank's queries through its first chunk only;
a shard from a later rank is seen whole by the rank's second chunk only. Non-causal specs take any shards, in rank
order or not, of any lengths.

Communication overlaps compute: the next shard's transfer is posted (`batch_isend_irecv`) before the current step's
kernels, and waited for after them; the dK/dV accumulator's transfer overlaps the next step.

A mask whose rows see only nearby keys (a sliding window) runs a halo exchange instead (`_plan`, `halo_forward`):
each rank receives, at once, the span of every other rank's keys its rows may see, as the mask's range hooks
bound them."""

# ruff: noqa: E741
# (the kernel names its output O, as kernel.py does)
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from ncd.errors import CallError
from ncd.families.attention import kernel_sink
from ncd.families.attention.kernel import AttentionKernels, _head, _load_rows, _row_program, _store_rows, head_tile
from ncd.families.attention.kernel_chunked import incoming_sums

BLOCK_ROWS = 32
_ALIGN = 16  # bytes: every tensor of a packed shard starts aligned for the kernels' loads and bulk copies


@triton.jit
def merge_kernel(
    O, Z, M, P, ZP, MP,
    stride_ob, stride_oh, stride_om, stride_od, stride_zb, stride_zh, stride_zm,
    stride_pb, stride_ph, stride_pm, stride_pd, stride_qb, stride_qh, stride_qm,
    HQ, N_Q,
    HEAD_DIM_V: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr,
    A1: tl.constexpr, A2: tl.constexpr, B: tl.constexpr, ONLINE_MAX: tl.constexpr,
):
    """The partial state (P, ZP, MP) of a block of rows merged into (O fp32, Z, M) in place (module docstring). A row
    with z = 0 saw no key of nonzero weight: it weighs nothing, and a row neither side saw stays (0, 0, 0)."""
    _, off_b, off_h, rows, in_q, offs_d, d_ok = _row_program(HQ, N_Q, BLOCK_M, HEAD_DIM_V, DV)
    o_base = _head(O, off_b, off_h, stride_ob, stride_oh)
    o = _load_rows(o_base, rows, stride_om, stride_od, offs_d, in_q, d_ok)
    p = _load_rows(_head(P, off_b, off_h, stride_pb, stride_ph), rows, stride_pm, stride_pd, offs_d, in_q,
                   d_ok).to(tl.float32)
    z_at = off_b.to(tl.int64) * stride_zb + off_h * stride_zh + rows * stride_zm
    p_at = off_b.to(tl.int64) * stride_qb + off_h * stride_qh + rows * stride_qm
    z = tl.load(Z + z_at, mask=in_q, other=0.0)
    zp = tl.load(ZP + p_at, mask=in_q, other=0.0)
    seen, seen_p = z != 0, zp != 0
    w = tl.where(seen, B(tl.where(seen, z, 1.0)), 0.0)  # o b(z): the row's numerator
    w_p = tl.where(seen_p, B(tl.where(seen_p, zp, 1.0)), 0.0)
    if ONLINE_MAX:
        m = tl.load(M + z_at, mask=in_q, other=0.0)
        mp = tl.load(MP + p_at, mask=in_q, other=0.0)
        m_new = tl.where(seen, tl.where(seen_p, tl.maximum(m, mp), m), tl.where(seen_p, mp, 0.0))
        shift, shift_p = tl.where(seen, m - m_new, 0.0), tl.where(seen_p, mp - m_new, 0.0)
        z_new = tl.where(seen, z * A2(shift), 0.0) + tl.where(seen_p, zp * A2(shift_p), 0.0)
        w = w * tl.where(seen, A1(shift), 0.0)
        w_p = w_p * tl.where(seen_p, A1(shift_p), 0.0)
        tl.store(M + z_at, m_new, mask=in_q)
    else:
        z_new = z + zp
    num = o * w[:, None] + p * w_p[:, None]
    kept = z_new != 0
    inv_b = tl.where(kept, 1.0 / B(tl.where(kept, z_new, 1.0)), 0.0)
    o = num * inv_b[:, None]
    _store_rows(o_base, o, rows, stride_om, stride_od, offs_d, in_q, d_ok)
    tl.store(Z + z_at, z_new, mask=in_q)


def merge(kernels: AttentionKernels, o: torch.Tensor, z: torch.Tensor, m: torch.Tensor | None, part: torch.Tensor,
          z_part: torch.Tensor, m_part: torch.Tensor | None) -> None:
    """Merge a partial forward (part [B, H, N, DV], z_part, m_part [B, H, N]) into the fp32 rows o, z, m in place;
    all may be views (strided along the rows)."""
    batch, hq, n_q, dv = o.shape
    m_arg, mp_arg = (m, m_part) if m is not None and m_part is not None else (z, z_part)
    merge_kernel[(triton.cdiv(n_q, BLOCK_ROWS), batch * hq)](
        o, z, m_arg, part, z_part, mp_arg, *o.stride(), *z.stride(), *part.stride(), *z_part.stride(), hq, n_q,
        HEAD_DIM_V=head_tile(dv), DV=dv, BLOCK_M=BLOCK_ROWS, A1=kernels.maps["A1"], A2=kernels.maps["A2"],
        B=kernels.maps["B"], ONLINE_MAX=kernels.config.online_max,
    )


# ---------------------------------------------------------------------------------------------
# The ring
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RingModifiers:
    """A spec's score and mask hooks on the ring (modifiers.py). context(q, k, tensors, place, columns): the hooks'
    context for one call (runtime.py), place = (query offset, key offset, total queries, total keys). tensors: the
    op's modifier tensors on this rank, with each one's query and key dimension (None: none): the query dimension
    is cut to the call's rows, the key dimension travels with the key shard. takes_grad: the tensors the kernels
    add gradients to (float tensors of the score), given buffers for all of them; wanted: the caller wants one of
    them (then the gradients of those over keys travel with the shards' dK/dV: `key_grad_shapes`). zigzag: a mask
    hides pairs (the causal layout). key_bound, bounds(q, k, tensors, place): the range hook that bounds a block
    of rows' keys without call-time tables (the compile-time bound where the kernels read tables: it reads no
    tensor over keys) and its context (`_plan`)."""

    context: Callable[..., tuple]
    tensors: tuple[torch.Tensor, ...]
    query_dims: tuple[int | None, ...]
    key_dims: tuple[int | None, ...]
    takes_grad: tuple[bool, ...]
    wanted: bool
    zigzag: bool
    key_bound: Any = None
    bounds: Callable[..., tuple] | None = None
    plans: dict | None = None  # `_plan`'s results by call (None: the mask reads tensors, so plans are per call)
    constants: tuple = ()  # the scalar inputs and sizes the hooks read (part of a plan's key)
    # per tensor, a key dimension held whole on every rank (a [head query key] bias: this rank's queries against
    # every key), cut to each call's keys by their place in the sequence; () or None: none
    whole_key_dims: tuple[int | None, ...] = ()

    def travelling(self) -> list[torch.Tensor]:
        return [t for t, d in zip(self.tensors, self.key_dims, strict=True) if d is not None]

    def shard_shapes(self, n_k: int) -> list[tuple[torch.Size, torch.dtype]]:
        """(shape, dtype) of the travelling tensors at key length n_k."""
        return [(torch.Size(n_k if i == d else size for i, size in enumerate(t.shape)), t.dtype)
                for t, d in zip(self.tensors, self.key_dims, strict=True) if d is not None]

    def key_grads(self) -> list[tuple[torch.Tensor, int]]:
        """(tensor, key dimension) of those whose fp32 gradients travel with a shard: the tensors over keys that
        take one, when the caller wants them."""
        if not self.wanted:
            return []
        return [(t, d) for t, d, grad in zip(self.tensors, self.key_dims, self.takes_grad, strict=True)
                if d is not None and grad]

    def key_grad_shapes(self, n_k: int) -> list[tuple[int, ...]]:
        """Their gradients' shapes at key length n_k."""
        return [tuple(n_k if i == d else size for i, size in enumerate(t.shape)) for t, d in self.key_grads()]

    def call(self, q: torch.Tensor, k: torch.Tensor, rows: slice, keys: slice, shard: list[torch.Tensor],
             place: tuple | None, columns: bool, buffers: list[torch.Tensor] | None = None,
             key_buffers: list[torch.Tensor] | None = None) -> tuple:
        """(context, gradient buffers G, [(part of a buffer, the call's buffer)]) of one call: this rank's q[rows]
        against the held shard's k[keys] (`shard`: its travelling tensors); buffers: the fp32 gradients of the
        tensors that take one (whole), of which those over keys are the held shard's, in key_buffers
        (`key_grad_shapes`). The kernels zero G before they add to it (kernel.py: the autotuner runs them
        repeatedly), so each call gets zeroed buffers of its own, added to the buffers after it."""
        held = iter(shard)
        tensors = []
        whole = self.whole_key_dims or (None,) * len(self.tensors)
        columns_at = slice(place[1], place[1] + keys.stop - keys.start) if place is not None else keys
        for t, q_dim, k_dim, w_dim in zip(self.tensors, self.query_dims, self.key_dims, whole, strict=True):
            if k_dim is not None:
                t = _cut(next(held), k_dim, keys)
            elif w_dim is not None:  # every key on this rank: the call's by their place in the sequence
                t = _cut(t, w_dim, columns_at)
            tensors.append(_cut(t, q_dim, rows) if q_dim is not None else t)
        grads: tuple = ()
        pairs = []
        dims = [(d, w, k_dim) for d, w, k_dim, g in zip(self.query_dims, whole, self.key_dims, self.takes_grad,
                                                        strict=True) if g] if buffers is not None else []
        held_grads = iter(key_buffers or [])
        for b, (dim, w_dim, k_dim) in zip(buffers or [], dims, strict=True):
            if k_dim is not None:  # (a tensor over keys has no query dimension: else it is held whole)
                part = _cut(next(held_grads), k_dim, keys)
            else:
                part = _cut(b, dim, rows) if dim is not None else b
                part = _cut(part, w_dim, columns_at) if w_dim is not None else part
            own = torch.zeros(part.shape, dtype=part.dtype, device=part.device)
            grads += (own, *own.stride())
            pairs.append((part, own))
        return self.context(q[:, :, rows], k[:, :, keys], tensors, place, columns), grads, pairs

    def reach(self, q: torch.Tensor, rows: slice, kv_heads: int, n_keys: int, place: tuple) -> torch.Tensor:
        """int32 (lo, hi, first, end): the keys [lo, hi) of a piece of n_keys keys at `place` that q[rows] may see,
        and the rows [first, end) (within `rows`, in blocks of REACH_ROWS) that may see one; lo >= hi: none. From
        the range hook over blocks of rows, every batch and head."""
        assert self.bounds is not None and self.key_bound is not None
        q_rows = q[:, :, rows]
        if not q_rows.shape[2] or not n_keys:
            return torch.tensor([0, 0, 0, 0], dtype=torch.int32, device=q.device)
        keys = torch.empty((q.shape[0], kv_heads, n_keys, 0), device="meta")  # (the context reads its shape)
        tensors = [_cut(t, d, rows) if d is not None else t for t, d in zip(self.tensors, self.query_dims, strict=True)]
        context = self.bounds(q_rows, keys, tensors, place)
        blocks = triton.cdiv(q_rows.shape[2], REACH_ROWS)
        found = torch.empty((q.shape[0] * q.shape[1], blocks, 2), dtype=torch.int32, device=q.device)
        reach_kernel[(blocks, q.shape[0] * q.shape[1])](found, context, q.shape[1], BLOCK=REACH_ROWS,
                                                       KEY_RANGE=self.key_bound)
        lo, hi = found[..., 0], found[..., 1]
        seen = hi > lo
        block = torch.arange(blocks, dtype=torch.int32, device=q.device)
        any_seen = seen.any(0)
        first = torch.where(any_seen, block, blocks).min() * REACH_ROWS
        end = torch.clamp((torch.where(any_seen, block, -1).max() + 1) * REACH_ROWS, max=q_rows.shape[2])
        return torch.stack([torch.where(seen, lo, n_keys).min(), torch.where(seen, hi, 0).max(), first, end])


REACH_ROWS = 4  # rows per block of the plan: calls trimmed to within 3 rows of those that see a key


@triton.jit
def reach_kernel(OUT, C, HQ, BLOCK: tl.constexpr, KEY_RANGE: tl.constexpr):
    """OUT[batch x head, block] = (lo, hi): the keys a block of BLOCK rows may see (the range hook's outer bounds)."""
    block, bh = tl.program_id(0), tl.program_id(1)
    rows = block * BLOCK + tl.arange(0, BLOCK)
    lo, _, _, hi = KEY_RANGE(rows, bh // HQ, bh % HQ, C)
    at = (bh * tl.num_programs(0) + block) * 2
    tl.store(OUT + at, lo)
    tl.store(OUT + at + 1, hi)


def _cut(t: torch.Tensor, dim: int, part: slice) -> torch.Tensor:
    return t[(slice(None),) * dim + (part,)]


Call = tuple[slice, slice, tuple | None]  # (query rows, keys of the held shard, place) of one kernel call


@dataclass(frozen=True)
class Ring:
    """One context-parallel call: the kernels (and their copy without the causal flag), the group, this rank,
    every rank's (query, key) shard lengths (from the shard check), the sink (its dimensions among batch, head,
    query, its constant place, u and u': kernel_sink.py), the rate of the row statistic's running-max term (lse)
    and the score and mask hooks' inputs. With modifiers, `calls` (`_plan`): per owner, this rank's calls against
    its shard, pairs the mask leaves empty dropped and keys trimmed to what the rows may see; `halo`: every rank's
    (lo, hi) of every owner's keys it needs, where the halo exchange runs instead of the ring (`halo_forward`)."""

    kernels: AttentionKernels
    unmasked: AttentionKernels
    scale: float
    group: Any
    rank: int
    world: int
    lengths: tuple[tuple[int, int], ...]
    sink: tuple | None = None
    stat_rate: float = 0.0
    modifiers: RingModifiers | None = None
    calls: tuple[tuple[Call, ...], ...] | None = None
    halo: tuple[tuple[tuple[int, int], ...], ...] | None = None

    @property
    def key_lengths(self) -> tuple[int, ...]:
        return tuple(n_k for _, n_k in self.lengths)

    @property
    def causal(self) -> bool:
        return self.kernels.causal

    def owner(self, step: int) -> int:
        """The rank whose key shard this rank holds at `step`."""
        return (self.rank - step) % self.world

    def blocks(self, step: int, n_q: int) -> list[tuple[slice, slice, AttentionKernels, tuple | None]]:
        """(query rows, key rows, kernels, place) of the calls at `step` (module docstring: the zigzag's three
        cases). With modifiers, the plan's calls against the owner's shard (`_plan`)."""
        whole = slice(None)
        owner = self.owner(step)
        if self.calls is not None:
            return [(rows, keys, self.kernels, place) for rows, keys, place in self.calls[owner]]
        if not self.causal or owner == self.rank:
            return [(whole, whole, self.kernels, None)]
        half = n_q // 2
        if owner < self.rank:  # its first chunk precedes both of ours; its second follows both
            return [(whole, slice(0, half), self.unmasked, None)]
        return [(slice(half, None), whole, self.unmasked, None)]  # it follows our first chunk, precedes our second

    def global_rank(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def exchange(self, send: torch.Tensor, receive: torch.Tensor, backwards: bool = False) -> list:
        """Post the send of `send` to the next rank and the receive of `receive` from the previous one (backwards:
        to the previous, from the next)."""
        nxt, prev = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        if backwards:
            nxt, prev = prev, nxt
        ops = [dist.P2POp(dist.isend, send, self.global_rank(nxt), self.group),
               dist.P2POp(dist.irecv, receive, self.global_rank(prev), self.group)]
        return dist.batch_isend_irecv(ops)

    def swap(self, sends: dict[int, torch.Tensor], receives: dict[int, torch.Tensor]) -> list:
        """Post sends and receives by peer (one batch: NCCL runs a communicator's transfers in order)."""
        ops = [dist.P2POp(dist.isend, t, self.global_rank(r), self.group) for r, t in sends.items()]
        ops += [dist.P2POp(dist.irecv, t, self.global_rank(r), self.group) for r, t in receives.items()]
        return dist.batch_isend_irecv(ops) if ops else []


def pieces(lengths: tuple[tuple[int, int], ...], rank: int, axis: int, zigzag: bool) -> list[tuple[slice, int]]:
    """(positions within the shard, offset in the whole sequence) of rank's contiguous pieces along the query
    (axis 0) or key (1) axis: the zigzag's two chunks, or the whole shard in rank order."""
    if zigzag:
        half = lengths[rank][axis] // 2
        return [(slice(0, half), rank * half), (slice(half, 2 * half), (2 * len(lengths) - 1 - rank) * half)]
    return [(slice(0, lengths[rank][axis]), sum(n[axis] for n in lengths[:rank]))]


def _plan(mods: RingModifiers, q: torch.Tensor, kv_heads: int, lengths: tuple[tuple[int, int], ...], rank: int,
          group: Any) -> tuple[tuple[tuple[Call, ...], ...], tuple | None]:
    """(calls, halo) of a masked ring (Ring). Each pair of a piece of this rank's queries and a piece of an owner's
    keys is bounded by the mask's range hook (`RingModifiers.reach`, one synchronisation for all pairs); the calls
    keep the pairs with a visible key, trimmed to the keys seen and to the rows (in blocks) that see one. One
    all_gather shares every rank's needs, the span of each owner's shard it sees. The halo exchange replaces the
    ring where it moves fewer keys than the ring (P - 1 shards) and holds at most two shards more than this one (a
    local mask: a sliding window), else None."""
    key = (lengths, rank, group, q.shape[:2], kv_heads, mods.constants, q.device)
    cached = mods.plans if not any(isinstance(c, torch.Tensor) for c in mods.constants) else None
    if cached is not None and key in cached:  # every rank hits or misses alike: the shard check compared lengths,
        return cached[key]                    # shapes and scalars
    world = len(lengths)
    totals = (sum(n for n, _ in lengths), sum(n for _, n in lengths))
    pairs = [(owner, rows, q_at, keys, k_at) for owner in range(world)
             for rows, q_at in pieces(lengths, rank, 0, mods.zigzag)
             for keys, k_at in pieces(lengths, owner, 1, mods.zigzag)]
    found = torch.stack([mods.reach(q, rows, kv_heads, keys.stop - keys.start, (q_at, k_at, *totals))
                         for _, rows, q_at, keys, k_at in pairs]).tolist() if pairs else []
    calls: list[list[Call]] = [[] for _ in range(world)]
    needs = [[lengths[o][1], 0] for o in range(world)]  # the enclosing span of each owner's keys seen
    for (owner, rows, q_at, keys, k_at), (lo, hi, first, end) in zip(pairs, found, strict=True):
        if lo < hi:
            calls[owner].append((slice(rows.start + first, rows.start + end), slice(keys.start + lo, keys.start + hi),
                                 (q_at + first, k_at + lo, *totals)))
            needs[owner] = [min(needs[owner][0], keys.start + lo), max(needs[owner][1], keys.start + hi)]
    mine = torch.tensor(needs, dtype=torch.int64, device=q.device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    table = tuple(tuple((lo, hi) if lo < hi and o != r else (0, 0) for o, (lo, hi) in enumerate(row.tolist()))
                  for r, row in enumerate(every))
    moved = [sum(hi - lo for lo, hi in row) for row in table]
    ring_moves = [totals[1] - lengths[r][1] for r in range(world)]
    local = all(m < ring and m <= 2 * lengths[r][1] for r, (m, ring) in enumerate(zip(moved, ring_moves,
                                                                                          strict=True)))
    plan = tuple(tuple(c) for c in calls), table if local else None
    if cached is not None:
        if len(cached) >= 16:
            cached.clear()
        cached[key] = plan
    return plan


def _pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors' bytes in one flat uint8 buffer, each padded to _ALIGN bytes (one transfer per step)."""
    parts = []
    for t in tensors:
        raw = t.contiguous().reshape(-1).view(torch.uint8)
        parts += [raw, raw.new_zeros(-raw.numel() % _ALIGN)]
    return torch.cat(parts)


def _unpack(buffer: torch.Tensor, shapes: list[tuple[torch.Size, torch.dtype]]) -> list[torch.Tensor]:
    out, at = [], 0
    for shape, dtype in shapes:
        size = shape.numel() * dtype.itemsize
        out.append(buffer[at:at + size].view(dtype).reshape(shape))
        at += size + (-size % _ALIGN)
    return out


def _packed_bytes(shapes: list[tuple[torch.Size, torch.dtype]]) -> int:
    return sum(s.numel() * d.itemsize + (-(s.numel() * d.itemsize) % _ALIGN) for s, d in shapes)


def _shard_shapes(k: torch.Tensor, v: torch.Tensor, w: torch.Tensor | None, n_k: int,
                  modifiers: RingModifiers | None = None) -> list[tuple[torch.Size, torch.dtype]]:
    """(shape, dtype) of a shard's k, v (and w, and the modifier tensors over keys) at key length n_k."""
    shapes = [(torch.Size((*k.shape[:2], n_k, k.shape[3])), k.dtype),
              (torch.Size((*v.shape[:2], n_k, v.shape[3])), v.dtype)]
    if w is not None:
        shapes.append((torch.Size((w.shape[0], n_k)), torch.float32))
    return shapes + (modifiers.shard_shapes(n_k) if modifiers is not None else [])


def _shard(ring: Ring, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor | None,
           keys: slice = slice(None)) -> torch.Tensor:
    """This rank's key shard (its `keys`) packed for the ring: k, v, w and the modifier tensors over keys."""
    mods = ring.modifiers
    travelling = [_cut(t, d, keys) for t, d in zip(mods.tensors, mods.key_dims, strict=True)
                  if d is not None] if mods is not None else []
    return _pack([k[:, :, keys], v[:, :, keys], *([w[:, keys].float()] if w is not None else []), *travelling])


Held = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list[torch.Tensor]]  # k, v, w, modifier tensors


def _held(ring: Ring, buffer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor | None,
          n_k: int) -> Held:
    """A received shard of n_k keys, unpacked: (k, v, w or None, the modifier tensors over keys)."""
    k_s, v_s, *rest = _unpack(buffer, _shard_shapes(k, v, w, n_k, ring.modifiers))
    return k_s, v_s, rest[0] if w is not None else None, rest[int(w is not None):]


def _own(ring: Ring, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor | None) -> Held:
    return k, v, None if w is None else w.float(), ring.modifiers.travelling() if ring.modifiers is not None else []


def _call_forward(ring: Ring, q: torch.Tensor, held: Held, rows: slice, keys: slice, place: tuple | None,
                  kernels: AttentionKernels | None = None) -> tuple:
    """(part, (z, m)) of q[rows] against the held shard's keys[keys] (kernels: the ring's unless given)."""
    k_s, v_s, w_s, travelling = held
    context = ring.modifiers.call(q, k_s, rows, keys, travelling, place, False)[0] \
        if ring.modifiers is not None else None
    return (kernels or ring.kernels).forward(q[:, :, rows], k_s[:, :, keys], v_s[:, :, keys],
                                             w_s[:, keys] if w_s is not None else None, ring.scale, context)


def _forward_calls(ring: Ring, blocks: list, q: torch.Tensor, held: Held, o: torch.Tensor, z: torch.Tensor,
                   m: torch.Tensor | None) -> None:
    """Merge the partial states of q's rows against the held shard's keys, call by call, into (o, z, m)."""
    for rows, keys, kernels, place in blocks:
        part, (z_p, m_p) = _call_forward(ring, q, held, rows, keys, place, kernels)
        merge(ring.kernels, o[:, :, rows], z[:, :, rows], m[:, :, rows] if m is not None else None, part, z_p, m_p)


def _call_backward(ring: Ring, do: torch.Tensor, q: torch.Tensor, o: torch.Tensor, z: torch.Tensor,
                   m: torch.Tensor | None, delta_in: torch.Tensor | None, held: Held, rows: slice, keys: slice,
                   place: tuple | None, buffers: list[torch.Tensor] | None, dw: torch.Tensor | None,
                   key_grads: list[torch.Tensor], kernels: AttentionKernels | None = None) -> tuple:
    """(dq, dk, dv) of one call in the kernels' dtypes; its modifier-tensor gradients added to `buffers` (those
    over keys to the held shard's `key_grads`), its per-key weight's to dw[:, keys]."""
    kernels = kernels or ring.kernels
    k_s, v_s, w_s, travelling = held
    w_b = w_s[:, keys] if w_s is not None else None
    stats = (z[:, :, rows].contiguous(), m[:, :, rows].contiguous() if m is not None else None)
    extra = None if delta_in is None else delta_in[:, :, rows].contiguous()
    context, g_args, pairs = ring.modifiers.call(q, k_s, rows, keys, travelling, place, True, buffers, key_grads) \
        if ring.modifiers is not None else (None, (), [])
    grads = kernels.backward(do[:, :, rows], q[:, :, rows], k_s[:, :, keys], v_s[:, :, keys], o[:, :, rows],
                             stats, w_b, ring.scale, context, g_args, delta_in=extra)
    for part, mine in pairs:
        part += mine
    if dw is not None and w_b is not None:
        dw[:, keys] += kernels.weight_gradient(do[:, :, rows], q[:, :, rows], k_s[:, :, keys], v_s[:, :, keys], w_b,
                                               o[:, :, rows], *stats, ring.scale, context)
    return grads


def _backward_calls(ring: Ring, blocks: list, do: torch.Tensor, q: torch.Tensor, o: torch.Tensor, z: torch.Tensor,
                    m: torch.Tensor | None, delta_in: torch.Tensor | None, held: Held, dq: torch.Tensor,
                    grads: tuple, buffers: list[torch.Tensor] | None) -> None:
    """Add the held shard's calls' gradients: to dq, to grads (dk, dv, dw or None, the modifier tensors' over keys:
    `_grad_buffer`) and to the other modifier tensors' buffers."""
    dk_s, dv_s, dw_s, key_grads = grads
    for rows, keys, kernels, place in blocks:
        dq_b, dk_b, dv_b = _call_backward(ring, do, q, o, z, m, delta_in, held, rows, keys, place, buffers, dw_s,
                                          key_grads, kernels)
        dq[:, :, rows] += dq_b
        dk_s[:, :, keys] += dk_b
        dv_s[:, :, keys] += dv_b


def _grad_shapes(ring: Ring, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor | None, n_k: int) -> list:
    """Shapes of a shard's travelling fp32 gradients at key length n_k: dK, dV, (w given) the weight's, and the
    modifier tensors' over keys (RingModifiers.key_grad_shapes)."""
    shapes = [(*k.shape[:2], n_k, k.shape[3]), (*v.shape[:2], n_k, v.shape[3])]
    if w is not None:
        shapes.append((w.shape[0], n_k))
    return shapes + (ring.modifiers.key_grad_shapes(n_k) if ring.modifiers is not None else [])


def _grad_size(ring: Ring, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor | None, n_k: int) -> int:
    return sum(math.prod(s) for s in _grad_shapes(ring, k, v, w, n_k))


def _grad_views(ring: Ring, flat: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor | None,
                n_k: int) -> tuple:
    """(dk, dv, dw or None, [the modifier tensors' over keys]) as views of a flat gradient buffer of n_k keys."""
    shapes = _grad_shapes(ring, k, v, w, n_k)
    views = [p.view(s) for p, s in zip(flat.split([math.prod(s) for s in shapes]), shapes, strict=True)]
    return views[0], views[1], views[2] if w is not None else None, views[2 + int(w is not None):]


def _grad_buffer(ring: Ring, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor | None, n_k: int) -> tuple:
    """(a zeroed fp32 flat buffer, its views): a shard's gradients, sent as one transfer."""
    flat = torch.zeros(_grad_size(ring, k, v, w, n_k), dtype=torch.float32, device=k.device)
    return flat, _grad_views(ring, flat, k, v, w, n_k)


def ring_forward(ring: Ring, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor | None) -> tuple:
    """(o fp32, z, m, the last shard held) of q's rows against every rank's keys (the backward starts from that
    shard, the next rank's)."""
    batch, hq, n_q, _ = q.shape
    o = torch.zeros((batch, hq, n_q, v.shape[3]), dtype=torch.float32, device=q.device)
    z = torch.zeros((batch, hq, n_q), dtype=torch.float32, device=q.device)
    m = torch.zeros_like(z) if ring.kernels.config.online_max else None
    shard = _shard(ring, k, v, w) if ring.world > 1 else k.new_empty(0, dtype=torch.uint8)  # (one rank: unused)
    for step in range(ring.world):
        pending = []
        if step + 1 < ring.world:
            incoming = shard.new_empty(_packed_bytes(_shard_shapes(k, v, w, ring.key_lengths[ring.owner(step + 1)],
                                                                   ring.modifiers)))
            pending = ring.exchange(shard, incoming)
        held = _own(ring, k, v, w) if step == 0 else _held(ring, shard, k, v, w, ring.key_lengths[ring.owner(step)])
        _forward_calls(ring, ring.blocks(step, n_q), q, held, o, z, m)
        for request in pending:
            request.wait()
        if pending:
            shard = incoming
    return o, z, m, shard


def ring_backward(ring: Ring, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  w: torch.Tensor | None, o: torch.Tensor, z: torch.Tensor, m: torch.Tensor | None,
                  last: torch.Tensor, delta_in: torch.Tensor | None = None, weight_grad: bool = False,
                  buffers: list[torch.Tensor] | None = None) -> tuple:
    """(dq, dk, dv, dw or None, [the modifier tensors' gradients over keys]) of this rank's shard: the ordinary
    backward against each shard in turn, from the
    rows' final (o, z, m). The ring turns the other way: it starts from the forward's last shard (`last`, the next
    rank's), each rank sending to the previous one, and ends with this rank's own keys. A shard's fp32 dK/dV (and
    the per-key weight's gradient, with weight_grad) accumulate as they travel with it, so the last transfer, of
    this rank's accumulator, overlaps the own-keys step. delta_in: the row statistic's gradient term (runtime.py's
    `_backward_lse`), added to each row's delta in every step. buffers: the modifier tensors' fp32 gradients
    (RingModifiers), added to."""
    n_q, world, rank = q.shape[2], ring.world, ring.rank
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    wg = w if weight_grad else None
    shard, incoming = last, last
    arriving: torch.Tensor | None = None  # the accumulator of the next step's shard, from the next rank
    pending_grads: list = []
    for turn in range(world):
        owner = (rank + 1 + turn) % world
        pending = []
        if turn + 2 < world:  # the next shard (the one after it is this rank's own)
            incoming = shard.new_empty(_packed_bytes(_shard_shapes(k, v, w, ring.key_lengths[(owner + 1) % world],
                                                                   ring.modifiers)))
            pending = ring.exchange(shard, incoming, backwards=True)
        held = _own(ring, k, v, w) if owner == rank else _held(ring, shard, k, v, w, ring.key_lengths[owner])
        grads, views = _grad_buffer(ring, k, v, wg, ring.key_lengths[owner])
        _backward_calls(ring, ring.blocks((rank - owner) % world, n_q), do, q, o, z, m, delta_in, held, dq, views,
                        buffers)
        if arriving is not None:  # what the ranks before this one added to the shard's gradients
            for request in pending_grads:
                request.wait()
            grads += arriving
        if owner != rank:
            arriving = grads.new_empty(_grad_size(ring, k, v, wg, ring.key_lengths[(owner + 1) % world]))
            pending_grads = ring.exchange(grads, arriving, backwards=True)
        for request in pending:
            request.wait()
        shard = incoming
    dk, dv, dw, key_grads = _grad_views(ring, grads, k, v, wg, k.shape[2])
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dw, key_grads


def _shifted(calls: tuple[Call, ...], by: int) -> list:
    """The calls against a halo whose first key is the shard's key `by`, with the kernels of a masked ring."""
    return [(rows, slice(keys.start - by, keys.stop - by), None, place) for rows, keys, place in calls]


class _Dense:
    """A result along one axis of a shard, cut into pieces (the zigzag's chunks), written once per piece by its lead
    call (the own call that covers most of it) and corrected in fp32 where other calls add to it: with a local
    mask those cover a few rows or keys (the halo), so the passes cost the overlap, not the shard."""

    def __init__(self, out: torch.Tensor, pieces: list[slice], leads: list[int | None]) -> None:
        self.out, self.pieces, self.leads = out, pieces, leads
        self.covered: list[slice | None] = [None] * len(pieces)
        self.extras: list[list[tuple[slice, torch.Tensor]]] = [[] for _ in pieces]

    def piece(self, part: slice) -> int:
        return next(i for i, p in enumerate(self.pieces) if p.start <= part.start < p.stop)

    def put(self, call: int, part: slice, value: torch.Tensor) -> None:
        """A call's result over `part`: written where the call is its piece's lead, else kept to add."""
        i = self.piece(part)
        if self.leads[i] == call:
            self.out[:, :, part] = value
            self.covered[i] = part
        else:
            self.extras[i].append((part, value))

    def finish(self) -> torch.Tensor:
        """Zeros where no lead wrote, then every piece's extras added in fp32 over their span, rounded once."""
        for piece, covered, extras in zip(self.pieces, self.covered, self.extras, strict=True):
            start, stop = (covered.start, covered.stop) if covered is not None else (piece.stop, piece.stop)
            self.out[:, :, piece.start:start] = 0
            self.out[:, :, stop:piece.stop] = 0
            if extras:
                span = slice(min(p.start for p, _ in extras), max(p.stop for p, _ in extras))
                total = self.out[:, :, span].float()
                for part, value in extras:
                    total[:, :, part.start - span.start:part.stop - span.start] += value
                self.out[:, :, span] = total
        return self.out


def _leads(calls: tuple[Call, ...], pieces: list[slice], axis: int) -> list[int | None]:
    """Per piece, the index of the own call that covers most of it along axis 0 (rows) or 1 (keys)."""
    leads: list[int | None] = []
    spans = [rows if axis == 0 else keys for rows, keys, _ in calls]
    for piece in pieces:
        inside = [(s.stop - s.start, -i, i) for i, s in enumerate(spans) if piece.start <= s.start < piece.stop]
        leads.append(max(inside)[2] if inside else None)
    return leads


def halo_forward(ring: Ring, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor | None) -> tuple:
    """(o, z, m, the halos received) where a mask is local (`_plan`): each rank sends every other rank the span of
    its keys that rank needs, at once, and runs its own keys while they travel. Each piece of rows takes its lead
    call's output as it is; the other calls merge into an fp32 copy of the rows they touch (o: q's dtype, or fp32
    with a sink, which merges last)."""
    assert ring.halo is not None and ring.calls is not None
    batch, hq, n_q, _ = q.shape
    kernels, rank = ring.kernels, ring.rank
    o = kernels.new((batch, hq, n_q, v.shape[3]), torch.float32 if ring.sink is not None else q.dtype, q.device)
    z = kernels.new((batch, hq, n_q), torch.float32, q.device)
    m = kernels.new((batch, hq, n_q), torch.float32, q.device) if kernels.config.online_max else None
    sends = {d: _shard(ring, k, v, w, slice(*row[rank])) for d, row in enumerate(ring.halo)
             if row[rank][1] > row[rank][0]}
    receives = {s: k.new_empty(_packed_bytes(_shard_shapes(k, v, w, hi - lo, ring.modifiers)), dtype=torch.uint8)
                for s, (lo, hi) in enumerate(ring.halo[rank]) if hi > lo}
    pending = ring.swap(sends, receives)
    rows = [p for p, _ in pieces(ring.lengths, rank, 0, ring.modifiers is not None and ring.modifiers.zigzag)]
    own = ring.calls[rank]
    dense = _Dense(o, rows, _leads(own, rows, 0))
    stats = [_Dense(s, rows, dense.leads) for s in (z, m) if s is not None]
    extra_calls = []
    held = _own(ring, k, v, w)
    for i, (part, keys, place) in enumerate(own):
        if i not in dense.leads:
            extra_calls.append((part, keys, place, held))
            continue
        out, found = _call_forward(ring, q, held, part, keys, place)
        for d, value in zip([dense, *stats], [out, *found], strict=False):
            d.put(i, part, value)
    for d in [dense, *stats]:
        d.finish()
    for request in pending:
        request.wait()
    for s, buffer in receives.items():
        lo, hi = ring.halo[rank][s]
        halo = _held(ring, buffer, k, v, w, hi - lo)
        extra_calls += [(part, keys, place, halo) for part, keys, _, place in _shifted(ring.calls[s], lo)]
    for piece in rows:  # the other calls merge into an fp32 copy of the rows they touch
        mine = [c for c in extra_calls if piece.start <= c[0].start < piece.stop]
        if not mine:
            continue
        span = slice(min(c[0].start for c in mine), max(c[0].stop for c in mine))
        total = o[:, :, span].float()
        for part, keys, place, held in mine:
            out, (z_p, m_p) = _call_forward(ring, q, held, part, keys, place)
            local = slice(part.start - span.start, part.stop - span.start)
            merge(kernels, total[:, :, local], z[:, :, part], m[:, :, part] if m is not None else None, out, z_p, m_p)
        o[:, :, span] = total
    return o, z, m, receives


def halo_backward(ring: Ring, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  w: torch.Tensor | None, o: torch.Tensor, z: torch.Tensor, m: torch.Tensor | None,
                  received: dict[int, torch.Tensor], delta_in: torch.Tensor | None = None, weight_grad: bool = False,
                  buffers: list[torch.Tensor] | None = None) -> tuple:
    """ring_backward's results where the forward ran the halo exchange: the halos' gradients first, sent home
    while this rank's own keys run; each owner adds what comes back to its span. dq, dk, dv are written by each
    piece's lead call and corrected in fp32 where the others add (`_Dense`); the weight's gradient is fp32."""
    assert ring.halo is not None and ring.calls is not None and ring.modifiers is not None
    rank, zigzag = ring.rank, ring.modifiers.zigzag
    wg = w if weight_grad else None
    rows = [p for p, _ in pieces(ring.lengths, rank, 0, zigzag)]
    keys_pieces = [p for p, _ in pieces(ring.lengths, rank, 1, zigzag)]
    own = ring.calls[rank]
    new = ring.kernels.new  # (poisoned with NaN in tests: every element must be written)
    dq = _Dense(new(q.shape, q.dtype, q.device), rows, _leads(own, rows, 0))
    key_leads = _leads(own, keys_pieces, 1)
    dk = _Dense(new(k.shape, k.dtype, k.device), keys_pieces, key_leads)
    dv = _Dense(new(v.shape, v.dtype, v.device), keys_pieces, key_leads)
    dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if wg is not None and w is not None else None
    sends = {}
    for s, buffer in received.items():  # the halos' gradients, sent home while the own keys run
        lo, hi = ring.halo[rank][s]
        sends[s], (dk_halo, dv_halo, dw_halo, key_halo) = _grad_buffer(ring, k, v, wg, hi - lo)
        halo = _held(ring, buffer, k, v, w, hi - lo)
        for part, keys, _, place in _shifted(ring.calls[s], lo):
            dq_b, dk_b, dv_b = _call_backward(ring, do, q, o, z, m, delta_in, halo, part, keys, place, buffers,
                                              dw_halo, key_halo)
            dq.extras[dq.piece(part)].append((part, dq_b))
            dk_halo[:, :, keys] += dk_b
            dv_halo[:, :, keys] += dv_b
    receives = {d: k.new_empty(_grad_size(ring, k, v, wg, row[rank][1] - row[rank][0]), dtype=torch.float32)
                for d, row in enumerate(ring.halo) if row[rank][1] > row[rank][0]}
    pending = ring.swap(sends, receives)
    held = _own(ring, k, v, w)
    key_grads = [torch.zeros(shape, dtype=torch.float32, device=k.device)
                 for shape in ring.modifiers.key_grad_shapes(k.shape[2])]
    for i, (part, keys, place) in enumerate(own):
        grads = _call_backward(ring, do, q, o, z, m, delta_in, held, part, keys, place, buffers, dw, key_grads)
        for dense, span, value in zip((dq, dk, dv), (part, keys, keys), grads, strict=True):
            dense.put(i, span, value)
    for request in pending:
        request.wait()
    for d, got in receives.items():
        lo, hi = ring.halo[d][rank]
        g_k, g_v, g_w, g_keys = _grad_views(ring, got, k, v, wg, hi - lo)
        for piece_index, piece in enumerate(keys_pieces):  # what came back, cut by the pieces it covers
            start, stop = max(lo, piece.start), min(hi, piece.stop)
            if start < stop:
                dk.extras[piece_index].append((slice(start, stop), g_k[:, :, start - lo:stop - lo]))
                dv.extras[piece_index].append((slice(start, stop), g_v[:, :, start - lo:stop - lo]))
        if dw is not None and g_w is not None:
            dw[:, lo:hi] += g_w
        for mine, got_key, (_, dim) in zip(key_grads, g_keys, ring.modifiers.key_grads(), strict=True):
            _cut(mine, dim, slice(lo, hi)).add_(got_key)
    return dq.finish(), dk.finish(), dv.finish(), dw, key_grads


class RingAttention(torch.autograd.Function):
    """(o, lse) of this rank's queries against every rank's keys, a sink merged once at the end (kernel_sink.py:
    the saved statistics then include it, so the backward kernels need nothing more); backward: the ring again
    (every rank must run it). lse = log of the row's normaliser sum, -inf for a row with z = 0."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor | None,
                sink: torch.Tensor | None, ring: Ring, *modifier_tensors: torch.Tensor) -> tuple:
        if ring.halo is not None:
            o, z, m, ctx.halos = halo_forward(ring, q, k, v, w)
        else:
            o, z, m, ctx.last = ring_forward(ring, q, k, v, w)
        if ring.sink is not None:
            dims, place, sink_map, _ = ring.sink
            out = kernel_sink.merge(ring.kernels, o, z, m, sink, dims, place, sink_map, q.dtype)
        else:
            out = o.to(q.dtype)
        lse = torch.log(torch.where(z > 0, z, 1.0))
        if ring.stat_rate and m is not None:
            lse = lse + ring.stat_rate * m
        lse = torch.where(z > 0, lse, float("-inf"))
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, w, sink, out, z, m)
        ctx.ring = ring
        ctx.mark_non_differentiable(z)
        return out, lse

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor | None, dlse: torch.Tensor | None) -> tuple:  # type: ignore[override]
        ring: Ring = ctx.ring
        q, k, v, w, sink, o, z, m = ctx.saved_tensors
        do = torch.zeros_like(o) if do is None else do
        delta_in = None
        if dlse is not None:  # d lse / d z = 1 / z (z relative to the running max, as the kernels keep it)
            delta_in = torch.where(z != 0, -dlse.float() / torch.where(z != 0, z, 1.0), 0.0)
        mods = ring.modifiers
        # (those over keys alone accumulate in the shards' travelling buffers: an empty place here)
        buffers = [torch.zeros(t.shape if d is None else (0,), dtype=torch.float32, device=t.device)
                   for t, d, grad in zip(mods.tensors, mods.key_dims, mods.takes_grad, strict=True) if grad] \
            if mods is not None and mods.wanted else None
        weight_grad = w is not None and ctx.needs_input_grad[3]
        if ring.halo is not None:
            dq, dk, dv, dw, key_grads = halo_backward(ring, do, q, k, v, w, o, z, m, ctx.halos, delta_in,
                                                      weight_grad, buffers)
        else:
            dq, dk, dv, dw, key_grads = ring_backward(ring, do, q, k, v, w, o, z, m, ctx.last, delta_in,
                                                      weight_grad, buffers)
            ctx.last = None
        mod_grads: list[torch.Tensor | None] = []
        if mods is not None:  # this rank's queries' share: the ranks' gradients sum to the whole one
            made, over_keys = iter(buffers or []), iter(key_grads)
            for t, grad, over in zip(mods.tensors, mods.takes_grad, mods.key_dims, strict=True):
                if not grad or buffers is None:
                    mod_grads.append(None)
                    continue
                whole = next(made)  # (those over keys: the ring's, of this rank's shard)
                mod_grads.append((next(over_keys) if over is not None else whole).to(t.dtype))
            mod_grads = [g if need else None for g, need in zip(mod_grads, ctx.needs_input_grad[6:], strict=True)]
        dsink = None
        if ring.sink is not None and sink is not None and ctx.needs_input_grad[4]:
            dims, _, sink_map, dsink_map = ring.sink
            dsink = kernel_sink.gradient(ring.kernels, do, o, z, m, sink, dims, sink_map, dsink_map, delta_in)
        return dq, dk, dv, dw, dsink, None, *mod_grads


# ---------------------------------------------------------------------------------------------
# The factorized form: states, not a ring
# ---------------------------------------------------------------------------------------------


def _places(rank: int, world: int, causal: bool) -> list[int]:
    """The places of a rank's segments among all ranks' pieces: the zigzag's two chunks, or the shard's rank."""
    return [rank, 2 * world - 1 - rank] if causal else [rank]


# torch 2.13 renamed all_gather_into_tensor (the old name warns there)
gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class Segments:
    """The factorized form's context parallelism (kernel_chunked.py): its a1, a2 are polynomials of the score, so a
    block of keys acts on every later query through one [D, 2D] state, and a block of queries on every earlier key
    through one more (the backward's). Each rank's segments are contiguous pieces of the sequence with their place
    among all ranks' pieces: the whole shard at place `rank`, or causal, the zigzag's two chunks at places r and
    2P - 1 - r. The segments run as one batch (2B rows: `split`), each from its own states raised by the totals of
    the segments before it (the backward's: after it; without a mask: every other segment), gathered once each
    way. The scans store each segment's total in fp32 as well, and the kernels that read the states add the
    incoming sums as they load them: no pass over the states, no second pass over the keys. confirm: the shard
    check still under way (Sharding.confirm), awaited after the first scan is queued, before the first collective."""

    kernels: Any  # FactorizedAttentionKernels
    scale: float
    group: Any
    rank: int
    world: int
    confirm: Callable[[], Any] | None = None

    @property
    def places(self) -> list[int]:
        return _places(self.rank, self.world, self.kernels.causal)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """[B, H, 2c, D] -> [2B, H, c, D] (row b * 2 + s: segment s of batch b); w [B, 2c] -> [2B, c]. A view at
        B = 1 (the kernels take strides), else a copy."""
        if not self.kernels.causal:
            return x
        if x.dim() == 2:
            return x.reshape(2 * x.shape[0], x.shape[1] // 2)
        b, h, n, d = x.shape
        if b == 1:
            return x.as_strided((2, h, n // 2, d), (n // 2 * x.stride(2), *x.stride()[1:]), x.storage_offset())
        return x.reshape(b, h, 2, n // 2, d).transpose(1, 2).reshape(2 * b, h, n // 2, d)

    def join(self, x: torch.Tensor) -> torch.Tensor:
        """The inverse of split for [2B, H, c, D] (a copy)."""
        if not self.kernels.causal:
            return x
        b2, h, n, d = x.shape
        return x.reshape(b2 // 2, 2, h, n, d).transpose(1, 2).reshape(b2 // 2, h, 2 * n, d)

    def result(self, shape: torch.Size, dtype: torch.dtype,
               device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(whole, its split view) for a result [B, H, 2c, D] that the kernels write in place (causal, B = 1: no
        join), else (None, None)."""
        if not self.kernels.causal or shape[0] != 1:
            return None, None
        whole = self.kernels.new(shape, dtype, device)
        return whole, self.split(whole)

    def exchange(self, totals: torch.Tensor, hkv: int, before: bool) -> torch.Tensor:
        """The incoming sums for this rank's segments from every rank's segment totals (fp32, a row per batch
        row of split's order and kv head: key_states'), in the same layout: one all_gather and one kernel."""
        segments = len(self.places)
        batch = totals.shape[0] // (segments * hkv)
        rows = totals.new_empty(self.world * totals.numel())
        gather_into(rows, totals.view(-1), group=self.group)
        return incoming_sums(rows, batch, segments, self.world, self.rank, self.kernels.causal, before)


class FactorizedContextParallel(torch.autograd.Function):
    """o of this rank's queries by the factorized form, states raised by the other ranks' (Segments)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor | None,
                plan: Segments) -> torch.Tensor:
        kernels = plan.kernels
        q2, k2, v2 = plan.split(q), plan.split(k), plan.split(v)  # (views at B = 1)
        w2 = None if w is None else plan.split(w)
        steps = triton.cdiv(k2.shape[2], kernels.chunk)
        causal = kernels.causal  # (the state before each chunk; else the total alone)
        (h, vec, wsum), totals = kernels.key_states(k2, v2, w2, steps if causal else 1, steps, causal, q.dtype,
                                                    totals=True)
        if plan.confirm is not None:  # (a shard that disagrees raises here, on every rank, before any collective)
            plan.confirm()
        incoming = plan.exchange(totals, k.shape[1], before=True)
        o, o_out = plan.result(q.shape, q.dtype, q.device)
        o2, z2 = kernels.factorized_output(q2, k2, v2, w2, plan.scale, h, vec, wsum, out=o_out, incoming=incoming)
        o = plan.join(o2) if o is None else o
        ctx.save_for_backward(q2, k2, v2, w2, o2, z2, h, vec, incoming)  # (the split views: no split again)
        ctx.inputs = tuple((x.shape, x.dtype, x.device) for x in (q, k, v))
        ctx.plan = plan
        return o

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor) -> tuple:  # type: ignore[override]
        plan: Segments = ctx.plan
        kernels = plan.kernels
        q2, k2, v2, w2, o2, z2, h, vec, incoming = ctx.saved_tensors
        do2 = plan.split(do)
        hkv = k2.shape[1]
        (dq, dq_out), (dk, dk_out), (dv, dv_out) = (plan.result(*like) for like in ctx.inputs)
        dq2, delta = kernels.factorized_dq(do2, q2, k2, v2, o2, (z2, h, vec), w2, plan.scale, out=dq_out,
                                           incoming=incoming)
        n_states, n_steps = kernels.states(q2.shape[2], k2.shape[2], kernels.chunk)[2:]
        (hb, vecb), totals = kernels.query_states(q2, do2, z2, delta, hkv, n_states, n_steps, kernels.causal,
                                                  q2.dtype, totals=True)
        dk2, dv2 = kernels.factorized_dkdv(do2, q2, k2, v2, z2, delta, hb, vecb, w2, plan.scale,
                                           out=None if dk_out is None else (dk_out, dv_out),
                                           incoming=plan.exchange(totals, hkv, before=False))
        return (plan.join(dq2) if dq is None else dq, plan.join(dk2) if dk is None else dk,
                plan.join(dv2) if dv is None else dv, None, None)


@dataclass(frozen=True)
class Sharding:
    """A process group (None: the world) and every rank's (query, key) shard lengths, as ncd.distributed's shard
    check gathered them: the op then needs no collective of its own to size its transfers. whole: the tensors over
    both the query and the key axis, by name, holding this rank's queries against every key (the op was given
    views cut to this rank's key length, for its shape checks). pending: the check still under way (lengths None):
    it returns the lengths or raises the check's CallError, the same on every rank."""

    group: Any
    lengths: tuple[tuple[int, int], ...] | None
    whole: tuple[tuple[str, torch.Tensor], ...] = ()
    pending: Callable[[], tuple[tuple[int, int], ...]] | None = None

    def confirm(self) -> tuple[tuple[int, int], ...]:
        """Every rank's lengths, once the check has passed."""
        if self.pending is not None:
            return self.pending()
        assert self.lengths is not None
        return self.lengths


def context_parallel(kernels: AttentionKernels, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     w: torch.Tensor | None, scale: float, group: Any, names: tuple[str, str],
                     factorized: Callable[[int, int], bool] | None = None, *, sink: torch.Tensor | None = None,
                     sink_spec: tuple | None = None, stat_rate: float = 0.0, return_lse: bool = False,
                     modifiers: RingModifiers | None = None) -> Any:
    """The op's o on this rank's shard of queries (kernel layout [B, Hq, Nq, D]) against every rank's keys. Every
    rank's (Nq, Nk) sizes the transfers: from group, a Sharding (ncd.distributed's shard check, maybe still under
    way: Sharding.confirm), else one all_gather of its own. Causal: the same even length for queries and keys on
    every rank, else the same CallError on every rank. names:
    the spec's names of q and k. factorized(total Nq, total Nk): whether the op would run its factorized form on one
    device at those lengths; then the states' form (Segments) runs instead of the ring. sink, sink_spec: the sink's
    logits (or None: a constant place) and (dims, place, u, u'), for the ring (Ring). return_lse: (o, lse).
    modifiers: the score and mask hooks' inputs; they run on the ring, with the zigzag layout where a mask hides
    pairs, else with shards in rank order (any lengths)."""
    table, sharding = None, group if isinstance(group, Sharding) else None
    if sharding is not None:
        group = sharding.group
    group = group if group is not dist.GroupMember.WORLD else None
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    # the fewest positions in all that the check can pass with (causal: shards alike; else one or more a rank):
    # where even these take the factorized form, it runs while the check is under way and awaits it before its
    # first collective (Segments.confirm; the form grows more favourable with length)
    least = (world * q.shape[2], world * k.shape[2]) if kernels.causal else (q.shape[2] + world - 1,
                                                                            k.shape[2] + world - 1)
    if (sharding is not None and sharding.lengths is None and modifiers is None and factorized is not None
            and factorized(*least)):
        _refuse_on_factorized(kernels.name, w, return_lse)
        plan = Segments(kernels, float(scale), group, rank, world, sharding.confirm)
        return FactorizedContextParallel.apply(q, k, v, w, plan)
    if sharding is not None:
        table = list(sharding.confirm())
    else:
        mine = torch.tensor([q.shape[2], k.shape[2]], dtype=torch.int64, device=q.device)
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine, group=group)
        table = [tuple(row.tolist()) for row in gathered]
    if kernels.causal or (modifiers is not None and modifiers.zigzag):
        for r, (n_q, n_k) in enumerate(table):
            if (n_q, n_k) != table[0] or n_q != n_k or n_q % 2:
                raise CallError(None, detail=f"rank {r}: {names[0]} holds {n_q} positions and {names[1]} {n_k}, "
                                f"rank 0's {table[0][0]} and {table[0][1]}: {'causal' if kernels.causal else 'masked'}"
                                " context parallelism takes two equal chunks of queries and keys per rank, the same "
                                "on every rank (ncd.distributed.zigzag_shard)")
    if modifiers is None and factorized is not None and factorized(sum(n for n, _ in table), sum(n for _, n in table)):
        _refuse_on_factorized(kernels.name, w, return_lse)
        return FactorizedContextParallel.apply(q, k, v, w, Segments(kernels, float(scale), group, rank, world))
    lengths = tuple((int(n_q), int(n_k)) for n_q, n_k in table)
    calls, halo = None, None
    if modifiers is not None and modifiers.zigzag:  # a mask hides pairs: what each rank's rows see
        calls, halo = _plan(modifiers, q, k.shape[1], lengths, rank, group)
    elif modifiers is not None:
        totals = (sum(n for n, _ in lengths), sum(n for _, n in lengths))
        calls = tuple(tuple((rows, keys, (q_at, k_at, *totals)) for rows, q_at in pieces(lengths, rank, 0, False)
                            for keys, k_at in pieces(lengths, owner, 1, False)) for owner in range(world))
    ring = Ring(kernels, kernels.without_causal(), float(scale), group, rank, world, lengths, sink_spec, stat_rate,
                modifiers, calls, halo)
    o, lse = RingAttention.apply(q, k, v, w, sink, ring, *(modifiers.tensors if modifiers is not None else ()))
    return (o, lse) if return_lse else o


def _refuse_on_factorized(name: str, w: torch.Tensor | None, return_lse: bool) -> None:
    """What the factorized form's context parallelism does not carry, refused on each rank alone."""
    wanted = "return_lse" if return_lse else "a per-key weight that requires grad" if (
        w is not None and w.requires_grad) else None
    if wanted is not None:
        raise CallError(None, detail=f"{name}: {wanted} under context parallelism runs on the ring, and at these "
                        "lengths the op runs its factorized form: load the op with factorize='never' "
                        "(Op.with_config) to take it")


def zigzag_shard(x: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s zigzag shard of the whole sequence x along `dim`: chunks rank and 2 world - 1 - rank of 2 world
    equal chunks, concatenated (the layout causal context parallelism takes)."""
    chunks = x.chunk(2 * world, dim)
    if len(chunks) != 2 * world or x.shape[dim] % (2 * world):
        raise ValueError(f"zigzag_shard: {x.shape[dim]} positions do not cut into {2 * world} equal chunks")
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim)


def zigzag_unshard(shards: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The whole sequence from every rank's zigzag shard, in rank order (the inverse of `zigzag_shard`)."""
    world = len(shards)
    halves = [s.chunk(2, dim) for s in shards]
    return torch.cat([halves[r][0] for r in range(world)] + [halves[r][1] for r in reversed(range(world))], dim)
