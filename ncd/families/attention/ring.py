"""Context-parallel attention: a ring over torch.distributed, derived from the streamability certificate.

Each rank holds a shard of the query and key axes. Key/value shards travel around the ring (rank r sends to r + 1 and
receives from r - 1); at step s rank r holds the shard of rank r - s and runs the ordinary streamed forward of its
queries against it, a partial state (o_s, z_s, m_s) over those keys. Partial states over disjoint keys combine by the
certificate's merge (`merge_kernel`, the combine of split-K decoding written for finished rows):

    m' = max(m, m_s),  z' = z a2(m - m') + z_s a2(m_s - m'),  o' = (o b(z) a1(m - m') + o_s b(z_s) a1(m_s - m')) / b(z')

(plain sums of z and of o b(z) without the running max), so every normaliser the family accepts runs on the ring.
The backward needs no merge: the gradient of a key shard is the ordinary backward of the queries against it, given
the rows' final (o, z, m). The shard travels again with an fp32 dK/dV accumulator that each rank adds its part to;
after a full turn the accumulator is home.

Causal specs use the zigzag layout: with P ranks the sequence is cut into 2P equal chunks and rank r holds chunks r
and 2P - 1 - r, concatenated (`zigzag_shard`). Then every step costs the same: step 0 is the causal kernel on the
rank's own shard; a shard from an earlier rank is seen whole by all the rank's queries through its first chunk only;
a shard from a later rank is seen whole by the rank's second chunk only. Non-causal specs take any shards, in rank
order or not, of any lengths.

Communication overlaps compute: the next shard's transfer is posted (`batch_isend_irecv`) before the current step's
kernels, and waited for after them; the dK/dV accumulator's transfer overlaps the next step."""

# ruff: noqa: E741
# (the kernel names its output O, as kernel.py does)
from __future__ import annotations

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
from ncd.families.attention.kernel_chunked import add_states

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
    them (then none has a key dimension). zigzag: a mask hides pairs (the causal layout)."""

    context: Callable[..., tuple]
    tensors: tuple[torch.Tensor, ...]
    query_dims: tuple[int | None, ...]
    key_dims: tuple[int | None, ...]
    takes_grad: tuple[bool, ...]
    wanted: bool
    zigzag: bool

    def travelling(self) -> list[torch.Tensor]:
        return [t for t, d in zip(self.tensors, self.key_dims, strict=True) if d is not None]

    def shard_shapes(self, n_k: int) -> list[tuple[torch.Size, torch.dtype]]:
        """(shape, dtype) of the travelling tensors at key length n_k."""
        return [(torch.Size(n_k if i == d else size for i, size in enumerate(t.shape)), t.dtype)
                for t, d in zip(self.tensors, self.key_dims, strict=True) if d is not None]

    def call(self, q: torch.Tensor, k: torch.Tensor, rows: slice, keys: slice, shard: list[torch.Tensor],
             place: tuple | None, columns: bool, buffers: list[torch.Tensor] | None = None) -> tuple:
        """(context, gradient buffers G, [(part of a buffer, the call's buffer)]) of one call: this rank's q[rows]
        against the held shard's k[keys] (`shard`: its travelling tensors); buffers: the fp32 gradients of the
        tensors that take one (whole). The kernels zero G before they add to it (kernel.py: the autotuner runs
        them repeatedly), so each call gets zeroed buffers of its own, added to `buffers` after it."""
        held = iter(shard)
        tensors = []
        for t, q_dim, k_dim in zip(self.tensors, self.query_dims, self.key_dims, strict=True):
            if k_dim is not None:
                t = _cut(next(held), k_dim, keys)
            tensors.append(_cut(t, q_dim, rows) if q_dim is not None else t)
        grads: tuple = ()
        pairs = []
        dims = [d for d, g in zip(self.query_dims, self.takes_grad, strict=True) if g] if buffers is not None else []
        for b, dim in zip(buffers or [], dims, strict=True):
            part = _cut(b, dim, rows) if dim is not None else b
            own = torch.zeros(part.shape, dtype=part.dtype, device=part.device)
            grads += (own, *own.stride())
            pairs.append((part, own))
        return self.context(q[:, :, rows], k[:, :, keys], tensors, place, columns), grads, pairs


def _cut(t: torch.Tensor, dim: int, part: slice) -> torch.Tensor:
    return t[(slice(None),) * dim + (part,)]


@dataclass(frozen=True)
class Ring:
    """One context-parallel call: the kernels (and their copy without the causal flag), the group, this rank,
    every rank's (query, key) shard lengths (from the shard check), the sink (its dimensions among batch, head,
    query, its constant place, u and u': kernel_sink.py), the rate of the row statistic's running-max term (lse)
    and the score and mask hooks' inputs."""

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
        cases). With modifiers, one call per pair of a query and a key piece, each with its place in the whole
        sequence (RingModifiers.call)."""
        whole = slice(None)
        owner = self.owner(step)
        if self.modifiers is not None:
            totals = (sum(n for n, _ in self.lengths), sum(n for _, n in self.lengths))
            return [(rows, keys, self.kernels, (q_at, k_at, *totals))
                    for rows, q_at in self.pieces(self.rank, 0) for keys, k_at in self.pieces(owner, 1)]
        if not self.causal or owner == self.rank:
            return [(whole, whole, self.kernels, None)]
        half = n_q // 2
        if owner < self.rank:  # its first chunk precedes both of ours; its second follows both
            return [(whole, slice(0, half), self.unmasked, None)]
        return [(slice(half, None), whole, self.unmasked, None)]  # it follows our first chunk, precedes our second

    def pieces(self, rank: int, axis: int) -> list[tuple[slice, int]]:
        """(positions within the shard, offset in the whole sequence) of rank's contiguous pieces along the query
        (axis 0) or key (1) axis: the zigzag's two chunks, or the whole shard in rank order."""
        assert self.modifiers is not None
        if self.modifiers.zigzag:
            half = self.lengths[rank][axis] // 2
            return [(slice(0, half), rank * half), (slice(half, 2 * half), (2 * self.world - 1 - rank) * half)]
        return [(slice(None), sum(lengths[axis] for lengths in self.lengths[:rank]))]

    def global_rank(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def exchange(self, send: torch.Tensor, receive: torch.Tensor) -> list:
        """Post the send of `send` to the next rank and the receive of `receive` from the previous one."""
        nxt, prev = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        ops = [dist.P2POp(dist.isend, send, self.global_rank(nxt), self.group),
               dist.P2POp(dist.irecv, receive, self.global_rank(prev), self.group)]
        return dist.batch_isend_irecv(ops)


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


def _shard(ring: Ring, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    """This rank's key shard packed for the ring: k, v, w and the modifier tensors over keys."""
    return _pack([k, v, *([w.float()] if w is not None else []),
                  *(ring.modifiers.travelling() if ring.modifiers is not None else [])])


def ring_forward(ring: Ring, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor | None) -> tuple:
    """(o fp32, z, m) of q's rows against every rank's keys."""
    batch, hq, n_q, _ = q.shape
    online = ring.kernels.config.online_max
    o = torch.zeros((batch, hq, n_q, v.shape[3]), dtype=torch.float32, device=q.device)
    z = torch.zeros((batch, hq, n_q), dtype=torch.float32, device=q.device)
    m = torch.zeros_like(z) if online else None
    mods = ring.modifiers
    shard = _shard(ring, k, v, w)
    for step in range(ring.world):
        pending = []
        if step + 1 < ring.world:
            incoming = shard.new_empty(_packed_bytes(_shard_shapes(k, v, w, ring.key_lengths[ring.owner(step + 1)],
                                                                   mods)))
            pending = ring.exchange(shard, incoming)
        k_s, v_s, *rest = _unpack(shard, _shard_shapes(k, v, w, ring.key_lengths[ring.owner(step)], mods))
        w_s, held = rest[:int(w is not None)], rest[int(w is not None):]
        for rows, keys, kernels, place in ring.blocks(step, n_q):
            w_b = w_s[0][:, keys] if w_s else None
            context = mods.call(q, k_s, rows, keys, held, place, False)[0] if mods is not None else None
            part, (z_p, m_p) = kernels.forward(q[:, :, rows], k_s[:, :, keys], v_s[:, :, keys], w_b, ring.scale,
                                               context)
            merge(ring.kernels, o[:, :, rows], z[:, :, rows], m[:, :, rows] if m is not None else None, part, z_p, m_p)
        for request in pending:
            request.wait()
        if pending:
            shard = incoming
    return o, z, m


def ring_backward(ring: Ring, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  w: torch.Tensor | None, o: torch.Tensor, z: torch.Tensor, m: torch.Tensor | None,
                  delta_in: torch.Tensor | None = None, weight_grad: bool = False,
                  buffers: list[torch.Tensor] | None = None) -> tuple:
    """(dq, dk, dv, dw or None) of this rank's shard: each step's ordinary backward against the shard held, from
    the rows' final (o, z, m); dK/dV (and the per-key weight's gradient, with weight_grad) accumulate in fp32 on the
    shard's turn around the ring. delta_in: the row statistic's gradient term (runtime.py's `_backward_lse`), added
    to each row's delta in every step. buffers: the modifier tensors' fp32 gradients (RingModifiers), added to."""
    n_q = q.shape[2]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    mods = ring.modifiers
    shard = _shard(ring, k, v, w)
    grads_home: torch.Tensor | None = None
    pending_grads: list = []
    for step in range(ring.world):
        owner = ring.owner(step)
        pending = []
        if step + 1 < ring.world:
            incoming = shard.new_empty(_packed_bytes(_shard_shapes(k, v, w, ring.key_lengths[ring.owner(step + 1)],
                                                                   mods)))
            pending = ring.exchange(shard, incoming)
        k_s, v_s, *rest = _unpack(shard, _shard_shapes(k, v, w, ring.key_lengths[owner], mods))
        w_s, held = rest[:int(w is not None)], rest[int(w is not None):]
        dk_s = torch.zeros(k_s.shape, dtype=torch.float32, device=q.device)
        dv_s = torch.zeros(v_s.shape, dtype=torch.float32, device=q.device)
        dw_s = torch.zeros(w_s[0].shape if weight_grad else (0,), dtype=torch.float32, device=q.device)
        for rows, keys, kernels, place in ring.blocks(step, n_q):
            w_b = w_s[0][:, keys] if w_s else None
            stats = (z[:, :, rows].contiguous(), m[:, :, rows].contiguous() if m is not None else None)
            extra = None if delta_in is None else delta_in[:, :, rows].contiguous()
            context, g_args, pairs = mods.call(q, k_s, rows, keys, held, place, True, buffers) if mods is not None \
                else (None, (), [])
            dq_b, dk_b, dv_b = kernels.backward(do[:, :, rows], q[:, :, rows], k_s[:, :, keys], v_s[:, :, keys],
                                                o[:, :, rows], stats, w_b, ring.scale, context, g_args,
                                                delta_in=extra)
            for part, own in pairs:
                part += own
            dq[:, :, rows] += dq_b
            dk_s[:, :, keys] += dk_b
            dv_s[:, :, keys] += dv_b
            if weight_grad and w_b is not None:
                dw_s[:, keys] += kernels.weight_gradient(do[:, :, rows], q[:, :, rows], k_s[:, :, keys],
                                                         v_s[:, :, keys], w_b, o[:, :, rows], *stats, ring.scale,
                                                         context)
        grads = torch.cat([dk_s.reshape(-1), dv_s.reshape(-1), dw_s.reshape(-1)])
        if grads_home is not None:  # the accumulator of this shard, from the ranks it visited before
            for request in pending_grads:
                request.wait()
            grads += grads_home
        if ring.world > 1:
            grads_home = grads.new_empty(_grad_size(k, v, w if weight_grad else None,
                                                    ring.key_lengths[ring.owner(step + 1)]))
            pending_grads = ring.exchange(grads, grads_home)
        else:
            grads_home = grads
        for request in pending:
            request.wait()
        if pending:
            shard = incoming
    for request in pending_grads:
        request.wait()
    assert grads_home is not None
    dk, dv, dw = grads_home.split([k.numel(), v.numel(), w.numel() if weight_grad and w is not None else 0])
    return (dq.to(q.dtype), dk.reshape(k.shape).to(k.dtype), dv.reshape(v.shape).to(v.dtype),
            dw.reshape(w.shape) if weight_grad and w is not None else None)


def _grad_size(k: torch.Tensor, v: torch.Tensor, w: torch.Tensor | None, n_k: int) -> int:
    """fp32 elements of a shard's travelling gradients at key length n_k: dK, dV and (w given) the weight's."""
    per_key = k.shape[0] * k.shape[1] * k.shape[3] + v.shape[0] * v.shape[1] * v.shape[3]
    return (per_key + (w.shape[0] if w is not None else 0)) * n_k


class RingAttention(torch.autograd.Function):
    """(o, lse) of this rank's queries against every rank's keys, a sink merged once at the end (kernel_sink.py:
    the saved statistics then include it, so the backward kernels need nothing more); backward: the ring again
    (every rank must run it). lse = log of the row's normaliser sum, -inf for a row with z = 0."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor | None,
                sink: torch.Tensor | None, ring: Ring, *modifier_tensors: torch.Tensor) -> tuple:
        o, z, m = ring_forward(ring, q, k, v, w)
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
        buffers = [torch.zeros(t.shape, dtype=torch.float32, device=t.device)
                   for t, grad in zip(mods.tensors, mods.takes_grad, strict=True) if grad] \
            if mods is not None and mods.wanted else None
        dq, dk, dv, dw = ring_backward(ring, do, q, k, v, w, o, z, m, delta_in,
                                       weight_grad=w is not None and ctx.needs_input_grad[3], buffers=buffers)
        mod_grads: list[torch.Tensor | None] = []
        if mods is not None:  # this rank's queries' share: the ranks' gradients sum to the whole one
            made = iter(buffers or [])
            mod_grads = [next(made).to(t.dtype) if grad and buffers is not None else None
                         for t, grad in zip(mods.tensors, mods.takes_grad, strict=True)]
            mod_grads = [g if need else None for g, need in zip(mod_grads, ctx.needs_input_grad[6:], strict=True)]
        dsink = None
        if ring.sink is not None and sink is not None and ctx.needs_input_grad[4]:
            dims, _, sink_map, dsink_map = ring.sink
            dsink = kernel_sink.gradient(ring.kernels, do, o, z, m, sink, dims, sink_map, dsink_map, delta_in)
        return dq, dk, dv, dw, dsink, None, *mod_grads


# ---------------------------------------------------------------------------------------------
# The factorized form: states, not a ring
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Segments:
    """The factorized form's context parallelism (kernel_chunked.py): its a1, a2 are polynomials of the score, so a
    block of keys acts on every later query through one [D, 2D] state, and a block of queries on every earlier key
    through one more (the backward's). Each rank's segments are contiguous pieces of the sequence with their place
    among all ranks' pieces: the whole shard at place `rank`, or causal, the zigzag's two chunks at places r and
    2P - 1 - r. The segments run as one batch (2B rows: `split`), each from its own states raised by the totals of
    the segments before it (the backward's: after it; without a mask: every other segment), gathered once each
    way. The causal scan stores one state more, the segment's total, so that no second pass over the keys runs."""

    kernels: Any  # FactorizedAttentionKernels
    scale: float
    group: Any
    rank: int
    world: int

    @property
    def places(self) -> list[int]:
        return self.places_of(self.rank)

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

    def result(self, like: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(whole, its split view) for a result shaped like `like` [B, H, 2c, D] that the kernels write in place
        (causal, B = 1: no join), else (None, None)."""
        if not self.kernels.causal or like.shape[0] != 1:
            return None, None
        whole = self.kernels.new(like.shape, like.dtype, like.device)
        return whole, self.split(whole)

    def places_of(self, rank: int) -> list[int]:
        return [rank, 2 * self.world - 1 - rank] if self.kernels.causal else [rank]

    def exchange(self, totals: tuple, hkv: int, before: bool) -> tuple:
        """The incoming sums for this rank's segments from every rank's segment totals: one all_gather, fp32.
        totals: [S B Hkv, ...] in split's row order, any of them None (the coefficients need no such sum)."""
        present = [t for t in totals if t is not None]
        segments = len(self.places)
        flat = torch.cat([t.float().reshape(-1) for t in present])
        rows = [torch.empty_like(flat) for _ in range(self.world)]
        dist.all_gather(rows, flat, group=self.group)
        sums = [torch.zeros((t.shape[0] // (segments * hkv), segments, hkv * t[0].numel()), device=t.device)
                for t in present]  # [B, S, Hkv * state]
        for rank, row in enumerate(rows):
            for total, theirs in zip(sums, row.split([t.numel() for t in present]), strict=True):
                theirs = theirs.reshape(total.shape)
                for s, place in enumerate(self.places):
                    for o, other in enumerate(self.places_of(rank)):
                        if (other < place if before else other > place) if self.kernels.causal else other != place:
                            total[:, s] += theirs[:, o]
        it = iter(sums)
        return tuple(None if t is None else next(it).reshape(t.shape) for t in totals)


class FactorizedContextParallel(torch.autograd.Function):
    """o of this rank's queries by the factorized form, states raised by the other ranks' (Segments)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor | None,
                plan: Segments) -> torch.Tensor:
        kernels = plan.kernels
        q2, k2, v2 = plan.split(q), plan.split(k), plan.split(v)  # (views at B = 1)
        w2 = None if w is None else plan.split(w)
        steps = triton.cdiv(k2.shape[2], kernels.chunk)
        if kernels.causal:  # the state before each chunk, and after the last: the total
            h, vec, wsum = kernels.key_states(k2, v2, w2, steps + 1, steps, True, q.dtype)
            last = -1
        else:
            h, vec, wsum = kernels.key_states(k2, v2, w2, 1, steps, False, q.dtype)
            last = 0
        totals = tuple(None if t is None else t[:, last] for t in (h, vec, wsum))
        add_states((h, vec, wsum), plan.exchange(totals, k.shape[1], before=True))
        o, o_out = plan.result(q)
        o2, z2 = kernels.factorized_output(q2, k2, v2, w2, plan.scale, h, vec, wsum, out=o_out)
        o = plan.join(o2) if o is None else o
        ctx.save_for_backward(q, k, v, w, o, z2, h, vec)
        ctx.plan = plan
        return o

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor) -> tuple:  # type: ignore[override]
        plan: Segments = ctx.plan
        kernels = plan.kernels
        q, k, v, w, o, z2, h, vec = ctx.saved_tensors
        q2, k2, v2, o2, do2 = (plan.split(x) for x in (q, k, v, o, do))
        w2 = None if w is None else plan.split(w)
        hkv = k2.shape[1]
        dq, dq_out = plan.result(q)
        dk, dk_out = plan.result(k)
        dv, dv_out = plan.result(v)
        dq2, delta = kernels.factorized_dq(do2, q2, k2, v2, o2, (z2, h, vec), w2, plan.scale, out=dq_out)
        totals = kernels.query_total(q2, do2, z2, delta, hkv)
        n_states, n_steps = kernels.states(q2.shape[2], k2.shape[2], kernels.chunk)[2:]
        hb, vecb = kernels.query_states(q2, do2, z2, delta, hkv, n_states, n_steps, kernels.causal, q2.dtype)
        add_states((hb, vecb), plan.exchange(totals, hkv, before=False))
        dk2, dv2 = kernels.factorized_dkdv(do2, q2, k2, v2, z2, delta, hb, vecb, w2, plan.scale,
                                           out=None if dk_out is None else (dk_out, dv_out))
        return (plan.join(dq2) if dq is None else dq, plan.join(dk2) if dk is None else dk,
                plan.join(dv2) if dv is None else dv, None, None)


@dataclass(frozen=True)
class Sharding:
    """A process group (None: the world) and every rank's (query, key) shard lengths, as ncd.distributed's shard
    check gathered them: the op then needs no collective of its own to size its transfers."""

    group: Any
    lengths: tuple[tuple[int, int], ...]


def context_parallel(kernels: AttentionKernels, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     w: torch.Tensor | None, scale: float, group: Any, names: tuple[str, str],
                     factorized: Callable[[int, int], bool] | None = None, *, sink: torch.Tensor | None = None,
                     sink_spec: tuple | None = None, stat_rate: float = 0.0, return_lse: bool = False,
                     modifiers: RingModifiers | None = None) -> Any:
    """The op's o on this rank's shard of queries (kernel layout [B, Hq, Nq, D]) against every rank's keys. One
    all_gather of every rank's (Nq, Nk) sizes the transfers (ncd.distributed checked the shards before the op ran);
    causal: the same even length for queries and keys on every rank, else the same CallError on every rank. names:
    the spec's names of q and k. factorized(total Nq, total Nk): whether the op would run its factorized form on one
    device at those lengths; then the states' form (Segments) runs instead of the ring. sink, sink_spec: the sink's
    logits (or None: a constant place) and (dims, place, u, u'), for the ring (Ring). return_lse: (o, lse).
    modifiers: the score and mask hooks' inputs; they run on the ring, with the zigzag layout where a mask hides
    pairs, else with shards in rank order (any lengths)."""
    table = None
    if isinstance(group, Sharding):
        group, table = group.group, list(group.lengths)
    group = group if group is not dist.GroupMember.WORLD else None
    world = dist.get_world_size(group)
    if table is None:
        mine = torch.tensor([q.shape[2], k.shape[2]], dtype=torch.int64, device=q.device)
        lengths = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(lengths, mine, group=group)
        table = [tuple(row.tolist()) for row in lengths]
    if kernels.causal or (modifiers is not None and modifiers.zigzag):
        for r, (n_q, n_k) in enumerate(table):
            if (n_q, n_k) != table[0] or n_q != n_k or n_q % 2:
                raise CallError(None, detail=f"rank {r}: {names[0]} holds {n_q} positions and {names[1]} {n_k}, "
                                f"rank 0's {table[0][0]} and {table[0][1]}: {'causal' if kernels.causal else 'masked'}"
                                " context parallelism takes two equal chunks of queries and keys per rank, the same "
                                "on every rank (ncd.distributed.zigzag_shard)")
    rank = dist.get_rank(group)
    if modifiers is None and factorized is not None and factorized(sum(n for n, _ in table), sum(n for _, n in table)):
        wanted = "return_lse" if return_lse else "a per-key weight that requires grad" if (
            w is not None and w.requires_grad) else None
        if wanted is not None:
            raise CallError(None, detail=f"{kernels.name}: {wanted} under context parallelism runs on the ring, "
                            "and at these lengths the op runs its factorized form: load the op with "
                            "factorize='never' (Op.with_config) to take it")
        return FactorizedContextParallel.apply(q, k, v, w, Segments(kernels, float(scale), group, rank, world))
    ring = Ring(kernels, kernels.without_causal(), float(scale), group, rank, world,
                tuple((int(n_q), int(n_k)) for n_q, n_k in table), sink_spec, stat_rate, modifiers)
    o, lse = RingAttention.apply(q, k, v, w, sink, ring, *(modifiers.tensors if modifiers is not None else ()))
    return (o, lse) if return_lse else o


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
