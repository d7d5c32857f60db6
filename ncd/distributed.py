"""Beyond one GPU over torch.distributed: context-parallel attention (`context_parallel_attention`, a ring derived
from the certificate: ncd/families/attention/ring.py) and sequence-parallel gated recurrences
(`sequence_parallel_chunk`). On each rank the result is the single-device op's on that rank's shard, forward and
backward.

Sequence parallelism: each rank holds a contiguous time shard of the same sequences.

The state map of one shard is affine, S_out = A S_in + F, and for every decay-gated recurrence A is the shard's
total decay: exp(sum of g) per head (simple GLA, Gated KalmaNet's two states, each with its own gate or none), per
key row (GLA's per-key gate) or exp(g T_shard) (RetNet's constant decay). So:

- Gated linear attention (simple GLA, GLA, RetNet): its outputs are linear in the incoming state too, so every
  rank runs the chunked op on its shard at once, from zero (rank 0: from the given initial state), which also gives
  F_r, its end state. One all_gather of (F_r, G_r), the shard's log decay total (torch.distributed.nn.functional:
  differentiable; its backward is one all-to-all); rank r folds the shards before it, S_in = exp(G_j) S_in + F_j
  for j < r, and adds what S_in gives: o_t += scale (q_t * exp(g_1 + ... + g_t))^T S_in, and its end state
  exp(G_r) S_in + F_r.
- Gated KalmaNet: its solve reads the whole state, so the incoming state must come first. Each rank but the last
  computes F_r with its own chunked op and no Chebyshev steps (the states do not depend on the solve, and its beta
  scalings are the spec's), one all_gather, the fold, then the chunked op on the shard from S_in.

- The delta rules: A is a matrix, not a decay, and the outputs are linear in S_in. One run per shard gives both
  terms: the values widened by K zero columns, the run starting from [0 | I] (rank 0: as it is), then one
  all_gather of the shards' (A, F) and the fold (`_delta_rule_parallel`).

Either way the result is the single-device recurrence's.

The shard checks gather a record of every rank's shapes on the host, over a gloo group of the same ranks (the
group itself where it has gloo): an NCCL gather that the host reads would wait for every kernel queued before it.
"""

from __future__ import annotations

import functools
import inspect
import struct
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_gather

from ncd.errors import CallError
from ncd.families.attention.ring import Sharding, gather_into, zigzag_shard, zigzag_unshard
from ncd.families.attention.runtime import AttentionOp
from ncd.families.recurrence.runtime import G_FLOOR, GKAOp
from ncd.families.recurrence.runtime_delta import DeltaRuleOp
from ncd.families.recurrence.runtime_linear import LinearScanOp
from ncd.families.recurrence.scales import BetaScales
from ncd.families.recurrence.states import outer_sum, project

_HOST_GROUPS: dict[int, tuple[Any, Any]] = {}  # id(group) -> (group, the gloo group its shard checks use)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_SHAPE_SLOTS = 6  # dims recorded per tensor in the shard check (the recurrences' inputs have at most 4)


__all__ = ["context_parallel_attention", "sequence_parallel_chunk", "zigzag_shard", "zigzag_unshard"]


def context_parallel_attention(op: Any, *args: Any, group: Any = None, **kwargs: Any) -> Any:
    """`op` (an `ncd.load`ed attention spec, or its `.module`) with its query and key axes sharded over the ranks of
    `group` (default: the world). Arguments as the op's, on every rank, each sequence tensor holding this rank's
    shard of the positions; the other axes whole and alike on every rank.

    - Causal specs, and specs with a mask, take the zigzag layout: the sequence cut into 2 P equal chunks (P ranks),
      rank r holding chunks r and 2 P - 1 - r, concatenated, queries and keys alike (`zigzag_shard(x, dim, rank, P)`;
      `zigzag_unshard` inverts it). So the length is a multiple of 2 P.
    - Other specs take any shards, of any lengths (each rank at least one position); with a score modifier, in rank
      order (rank r holds the positions after rank r - 1's).
    - A modifier tensor over the query axis (q_doc [batch query]) is sharded as the queries, one over the key axis
      (k_doc [batch key]) as the keys (it travels with them), one over both (bias [head query key]) as the queries
      with every key, the others whole on every rank; the hooks see positions in the whole sequence. A float
      modifier tensor's gradient on each rank is that rank's queries' share (the ranks' gradients sum to the whole
      one, as a sink's, and as DDP sums them), except over the key axis alone: there it is the whole gradient of the
      rank's keys, from every rank's queries.

    Returns the op's output on this rank's queries. Gradients reach every rank's inputs; every rank must run the
    backward (it is a ring too). The shards are checked together (one all_gather on the host, before the op's
    first collective; the factorized form queues its first scan meanwhile): a rank whose shard disagrees with rank
    0's, or fails the op's own checks, raises the same CallError on every rank, naming the rank, the tensor and the
    axis. Sinks, return_lse and a per-key weight's gradient are carried (the latter two on the
    ring only: CallError where the op would run its factorized form), and score and mask modifiers (on the ring; a
    mask whose rows see only nearby keys, such as a sliding window, by a halo exchange of those keys); the gradient
    of a tensor over the key axis alone travels home with the keys' dK/dV. A tensor over both the query and key axes
    (a [head query key] bias) holds this rank's queries against every key, in sequence order. The scalars that the
    hooks read must be alike on every rank (checked with the shards)."""
    module = getattr(op, "module", op)
    runtime = getattr(module, "_OP", None)
    if not isinstance(runtime, AttentionOp):
        raise CallError(None, detail=f"{getattr(module, 'NAME', module)}: context parallelism is for attention specs")
    if group is None and not dist.is_initialized():
        raise CallError(None, detail="context parallelism needs a process group: call "
                        "torch.distributed.init_process_group first, or pass group=")
    group = group if group is not None else dist.group.WORLD
    fn = op.fn if hasattr(op, "fn") else module.Module()
    call = inspect.signature(fn).bind(*args, **kwargs)
    whole = _whole_key_tensors(runtime, call.arguments)
    for name, (tensor, dim, n_k) in whole.items():  # the op checks a view at this rank's key length
        call.arguments[name] = tensor.narrow(dim, 0, min(n_k, tensor.shape[dim]))
    sharding = _check_context_shards(runtime, call.arguments, group, whole, wait=False)
    return fn(*call.args, _group=sharding, **call.kwargs)


def _whole_key_tensors(runtime: AttentionOp, given: dict) -> dict[str, tuple[torch.Tensor, int, int]]:
    """The tensors over both the query and the key axis (a [head query key] bias), which each rank passes as its
    queries against every key: name -> (tensor, its key dimension, this rank's key length, from K)."""
    q_axis, k_axis = runtime.sequence
    axes = dict(runtime.inputs)
    keys = given.get(runtime.key)
    if not isinstance(keys, torch.Tensor) or runtime.key not in axes:
        return {}
    n_k = keys.shape[axes[runtime.key].index(k_axis)]
    return {name: (given[name], dims.index(k_axis), n_k) for name, dims in runtime.inputs
            if q_axis in dims and k_axis in dims and isinstance(given.get(name), torch.Tensor)}


def _bits(value: Any) -> int:
    """A scalar input as the int64 of its float64 bits (None: the default, -1)."""
    if value is None:
        return -1
    number = float(value.item() if isinstance(value, torch.Tensor) else value)
    return struct.unpack("<q", struct.pack("<d", number))[0]


def _shown(kind: int, bits: int) -> str:
    if bits == -1:
        return "the default"
    return ("a tensor holding " if kind else "") + f"{struct.unpack('<d', struct.pack('<q', bits))[0]:g}"


def _check_context_shards(runtime: AttentionOp, given: dict, group: Any,
                          whole: dict[str, tuple[torch.Tensor, int, int]] | None = None, wait: bool = True) -> Sharding:
    """Every rank's tensors against rank 0's: the same dtypes and sizes but in the query and key axes (causal: those
    too, an even length: the zigzag's two chunks), each passing the op's own checks. One all_gather of every rank's
    shapes and dtypes (and, only where a rank failed its own checks, one all_gather_object of the messages); a
    problem anywhere raises the same CallError on every rank. Returns the group with every rank's lengths; wait
    False: with the gather under way where this rank passed its own checks (Sharding.confirm awaits it)."""
    tensors = [(name, given.get(name), axes) for name, axes in runtime.inputs]
    problem: Exception | None = None
    try:
        runtime.check(*(t for _, t, _ in tensors))  # type: ignore[arg-type]  # (a None fails the check)
    except Exception as error:  # (relayed to every rank, raised as itself on this one)
        problem = error
    record = [int(problem is not None)]
    for _, t, _ in tensors:
        dims = list(t.shape)[:_SHAPE_SLOTS] if isinstance(t, torch.Tensor) else []
        code = (_DTYPES.index(t.dtype) if t.dtype in _DTYPES else len(_DTYPES)) if isinstance(t, torch.Tensor) else -1
        record += [code, len(dims), *dims, *[-1] * (_SHAPE_SLOTS - len(dims))]
    whole = whole or {}
    record += [tensor.shape[dim] for tensor, dim, _ in whole.values()]  # their key lengths: every key
    scalars = [(name, given.get(name)) for name in runtime.mod_scalars]
    for _, value in scalars:  # what a mask or score reads besides positions: alike on every rank
        record += [int(isinstance(value, torch.Tensor)), _bits(value)]
    whole_tuple = tuple((name, tensor) for name, (tensor, _, _) in whole.items())
    host = _host_group(group)
    gathered = _post_records(record, host)
    finish = functools.partial(_compare_context_shards, runtime, tensors, scalars, whole, problem, gathered, host)
    if wait or problem is not None:
        return Sharding(group, finish(), whole_tuple)
    return Sharding(group, None, whole_tuple, _once(finish))


def _once(fn: Callable[[], Any]) -> Callable[[], Any]:
    """fn, called at most once: later calls return its result or raise its error again."""
    outcome: list = []

    def call() -> Any:
        if not outcome:
            try:
                outcome.append((True, fn()))
            except Exception as error:
                outcome.append((False, error))
        done, value = outcome[0]
        if not done:
            raise value
        return value

    return call


def _compare_context_shards(runtime: AttentionOp, tensors: list, scalars: list, whole: dict,
                            problem: Exception | None, gathered: Callable[[], list[list[int]]],
                            host: Any) -> tuple[tuple[int, int], ...]:
    """_check_context_shards' verdict on the records (`gathered` awaits them): every rank's (query, key) lengths,
    or its CallError (the failing ranks' own messages gathered over `host`)."""
    table = gathered()
    if any(row[0] for row in table):  # the failing ranks' own messages, to every rank
        messages: list[Any] = [None] * len(table)
        text = problem.message if isinstance(problem, CallError) else str(problem)
        dist.all_gather_object(messages, text if problem is not None else None, group=host)
        r = next(r for r, row in enumerate(table) if row[0])
        raise CallError(None, detail=f"rank {r}: {messages[r]}") from problem
    causal = runtime.ns["KERNELS"].causal
    width = 2 + _SHAPE_SLOTS
    at = 1 + len(tensors) * width + len(whole)
    for r, row in enumerate(table):
        for i, (name, _) in enumerate(scalars):
            (kind, bits), (kind_0, bits_0) = row[at + 2 * i:at + 2 * i + 2], table[0][at + 2 * i:at + 2 * i + 2]
            if (kind, bits) != (kind_0, bits_0):
                raise CallError(None, detail=f"rank {r}: {name} is {_shown(kind, bits)}, rank 0's "
                                f"{_shown(kind_0, bits_0)} (a scalar that the hooks read is alike on every rank)")
    lengths: list[tuple[int, int]] = []
    for r, row in enumerate(table):
        found: dict[str, int] = {}
        for i, (name, _, axes) in enumerate(tensors):
            got, ref = row[1 + i * width:1 + (i + 1) * width], table[0][1 + i * width:1 + (i + 1) * width]
            if got[0] != ref[0]:
                raise CallError(None, detail=f"rank {r}: {name} has dtype {_dtype_name(got[0])}, rank 0's "
                                f"{_dtype_name(ref[0])} (context-parallel shards must agree)")
            for axis, size, want in zip(axes, got[2:2 + got[1]], ref[2:2 + ref[1]], strict=False):
                sharded = axis in runtime.sequence
                found.setdefault(axis, size)
                if sharded and size < 1:
                    raise CallError(None, detail=f"rank {r}: {name} holds no positions (axis '{axis}'); every rank "
                                    "needs a shard")
                if sharded and causal and (size != want or size % 2):
                    raise CallError(None, detail=f"rank {r}: {name} has axis '{axis}' of size {size}, rank 0's "
                                    f"{want}: causal context parallelism takes two equal chunks per rank, the same on "
                                    "every rank (ncd.distributed.zigzag_shard)")
                if not sharded and size != want:
                    raise CallError(None, detail=f"rank {r}: {name} has axis '{axis}' of size {size}, rank 0's {want} "
                                    "(shards differ in the query and key axes only)")
        lengths.append((found[runtime.sequence[0]], found[runtime.sequence[1]]))
    total = sum(n_k for _, n_k in lengths)
    for r, row in enumerate(table):
        for i, name in enumerate(whole):
            size = row[1 + len(tensors) * width + i]
            if size != total:
                q_axis, k_axis = runtime.sequence
                raise CallError(None, detail=f"rank {r}: {name} has axis '{k_axis}' of size {size}; under context "
                                f"parallelism a tensor over both '{q_axis}' and '{k_axis}' holds this rank's "
                                f"'{q_axis}' positions against every '{k_axis}' position: {total}")
    return tuple(lengths)


def sequence_parallel_chunk(op: Any, *args: Any, group: Any = None, **kwargs: Any) -> tuple:
    """`op`'s chunked recurrence (an `ncd.load`ed recurrence spec, or its `.module`) with the time axis sharded
    over the ranks of `group` (default: the world). Arguments as the op's `chunk`, on every rank: tensors in fla's
    layout [B, T_r, H, ...] holding tokens [sum of T_j for j < r, + T_r) of the same B sequences, in rank order
    (shards may differ in length; every rank at least one token); the gates, scale and knobs alike on every rank.
    `initial_state` is the sequences' state before their first token and is read on rank 0 only; with
    `output_final_state`, each rank returns the state after its own shard (the last rank's: after the sequences).
    Returns (o [B, T_r, H, V], final state or None) on each rank; gradients reach every rank's inputs, so every
    rank must run the backward, also where only rank 0's initial state takes a gradient (under grad mode every
    rank's output is tied to the states' gather). The delta rules: every rank but the first runs its shard with K
    more value columns, which carry its state map.
    cu_seqlens packing and head-first specs are not supported here. A rank whose
    shard disagrees with rank 0's in any axis but time, or in dtype, raises CallError on every rank."""
    module = getattr(op, "module", op)
    runtime, chunk = module._OP, module.chunk
    name = runtime.spec_name
    if not isinstance(runtime, (GKAOp, LinearScanOp)):
        raise CallError(None, detail=f"{name}: sequence parallelism takes the gated recurrences (GKA, gated linear "
                        "attention, the delta rules)")
    if runtime.roles.head_first:
        raise CallError(None, detail=f"{name}: sequence parallelism shards fla's layout [batch time head dim]; "
                        "this spec declares its inputs head-first")
    call = inspect.signature(chunk).bind(*args, **kwargs)
    call.apply_defaults()
    given = call.arguments
    if given.get("cu_seqlens") is not None:
        raise CallError(None, detail=f"{name}: sequence parallelism takes unpacked sequences (cu_seqlens None)")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    _check_shards(runtime, given, rank, world, group)
    states = _state_count(runtime)
    initial, want_final = given["initial_state"], given["output_final_state"]

    def run(initial_state: Any, final: bool, **knobs: Any) -> tuple:
        return chunk(**{**given, "initial_state": initial_state, "output_final_state": final, **knobs})

    start = initial if rank == 0 else None
    if isinstance(runtime, DeltaRuleOp):  # the state map is a matrix: S_out = A S_in + F
        return _delta_rule_parallel(runtime, chunk, given, rank, world, group)
    decays = _log_decays(runtime, given)
    if isinstance(runtime, GKAOp):  # the solve reads the whole state: the incoming state must come first
        if rank == world - 1:  # nobody reads the last shard's end state: zeros of the states' shapes
            ends = [torch.zeros(_state_shape(runtime, given, i), device=given["q"].device) for i in range(states)]
        elif given["k"].shape[2] == given["q"].shape[2]:
            ends = _gka_end_states(runtime, module.HOOKS, given, start)
        else:  # GQA: the op itself, with no Chebyshev steps
            ends = list(run(start, True, num_iter=0)[1])
        gathered = _gather_states(torch.cat([t.float().reshape(-1) for t in (*ends, *decays)]), group)
        incoming = _fold(gathered[:rank], [e.shape for e in ends], [d.shape for d in decays])
        if rank > 0:
            start = tuple(incoming)
        o, final = run(start, want_final)
    else:  # linear in the state: every shard runs at once from zero, then adds what the incoming state gives
        o, end = run(start, True)
        gathered = _gather_states(torch.cat([t.float().reshape(-1) for t in (end, *decays)]), group)
        final = end
        if rank > 0:
            (incoming_state,) = _fold(gathered[:rank], [end.shape], [d.shape for d in decays])
            o = o + _incoming_output(runtime, given, incoming_state).to(o.dtype)
            final = torch.exp(decays[0]) * incoming_state + end
    o = _Tie.apply(o, *gathered)  # every rank's backward reaches the gather, so its all-to-all runs on every rank
    if not want_final:
        final = None
    elif isinstance(final, list):
        final = tuple(final)
    return o, final


def _delta_rule_parallel(runtime: Any, chunk: Any, given: dict, rank: int, world: int, group: Any) -> tuple:
    """The delta rules' sequence parallelism, every shard at once. A shard maps its incoming state affinely,
    S_t = A_t S_in + F_t (DeltaRuleOp.chunk_with_state_map: one run gives F, A and the outputs' two terms). One
    all_gather of the shards' (A, F); rank r folds S_in = A_j S_in + F_j over the ranks before it, adds S_in's term
    to its outputs and A S_in to its final state. Rank 0 starts from the initial state and runs as it is."""
    want_final = given["output_final_state"]
    if rank == 0:
        o, end = chunk(**{**given, "output_final_state": True})
        k = given["k"]
        maps = k.new_zeros(k.shape[0], given["q"].shape[2], k.shape[-1], k.shape[-1], dtype=torch.float32)  # unread
    else:
        o, o_maps, end, maps = runtime.chunk_with_state_map(**{n: given.get(n) for n in ("q", "k", "v", "g", "beta",
                                                                                            "scale", "chunk_size")})
    mine = torch.cat([maps.float().reshape(-1), end.float().reshape(-1)])
    gathered = _gather_states(mine, group)
    final = end
    if rank > 0:
        state = None
        for packed in gathered[:rank]:
            a, f = packed.split([maps.numel(), end.numel()])
            a, f = a.reshape(maps.shape), f.reshape(end.shape)
            state = f if state is None else a @ state + f
        assert state is not None
        incoming = project(o_maps, state, torch.ones_like(o_maps[..., 0], dtype=torch.float32))
        o = (o.float() + incoming).to(o.dtype)  # (one rounding, as the whole-sequence op's)
        final = maps @ state + end
    o = _Tie.apply(o, *gathered)  # every rank's backward reaches the gather, so its all-to-all runs on every rank
    return o, final if want_final else None


def _gather_states(mine: torch.Tensor, group: Any) -> list[torch.Tensor]:
    """Every rank's flat states, differentiably. Under grad mode each rank's part requires a gradient even where
    none of its inputs does (rank 0's initial state may be the only one that does): every rank's outputs then
    reach the gather, and so every rank's backward runs its collective."""
    if torch.is_grad_enabled() and not mine.requires_grad:
        mine = mine.detach().requires_grad_()
    return list(all_gather(mine, group=group))


def _incoming_output(runtime: Any, given: dict, state: torch.Tensor) -> torch.Tensor:
    """What an incoming state S [B, H, K, V] adds to gated linear attention's outputs on this shard: o_t gains
    scale (q_t * exp(g_1 + ... + g_t))^T S (S_t = exp(g_t) S_(t-1) + k_t v_t^T is linear in S_0), fp32."""
    q = given["q"]
    sizes = runtime._check(q, given["k"], given["v"], given.get("g"), None, None, None, None,
                           given.get("chunk_size") or runtime.chunk_size)
    scale, scale_tensor = runtime._kernel_scale(given.get("scale"), sizes)
    g = _cumsum_over_time(_linear_gates(runtime, given))  # [B, T, H] or, per key, [B, T, H, K]
    if g.dim() == 4:  # a decay per key: it weights q's entries, not the row
        out = project(q.float() * torch.exp(g), state, torch.full_like(g[..., 0], scale))
    else:
        out = project(q, state, torch.exp(g) * scale)
    return out if scale_tensor is None else out * scale_tensor


def _cumsum_over_time(x: torch.Tensor) -> torch.Tensor:
    """x.cumsum(1) for x [B, T, ...], scanned with time innermost: torch scans an outer axis with one thread per
    inner element (B H of them here): 4.84 ms against 0.049 ms at [1, 32768, 16] on an H100."""
    return x.movedim(1, -1).contiguous().cumsum(-1).movedim(-1, 1)


def _state_count(runtime: Any) -> int:
    return 2 if isinstance(runtime, GKAOp) else 1


def _state_shape(runtime: Any, given: dict, index: int) -> tuple[int, ...]:
    q, v = given["q"], given["v"]
    B, _, H, K = q.shape
    if isinstance(runtime, GKAOp) and index == 0:
        return (B, H, K, K)
    return (B, H, K, v.shape[-1])


def _linear_gates(runtime: Any, given: dict) -> torch.Tensor:
    """Gated linear attention's log gates per token, fp32: [B, T, H] or, per key, [B, T, H, K]."""
    q, g = given["q"], given.get("g")
    B, T, H, _ = q.shape
    if g is None or runtime.roles.g is None:
        return torch.zeros(B, T, H, device=q.device)
    if runtime.roles.gate_per_head:  # RetNet: g [H], the same decay at every token
        return g.float().reshape(1, 1, H).expand(B, T, H)
    return g.float()


def _gka_end_states(runtime: Any, hooks: Any, given: dict, start: Any) -> list[torch.Tensor]:
    """Gated KalmaNet's states after this shard, fp32 [B, H, K, K] and [B, H, K, V], from `start` ((H, S) or None:
    zeros): H = sum_t exp(gh_(t+1) + ... + gh_T) kb_t kb_t^T and S = sum_t exp(g_(t+1) + ... + g_T) kb_t vb_t^T
    (+ the decayed start), kb = k KEY_SCALE(beta), vb = v VALUE_SCALE(beta) by the spec's own hooks (scales.py), the
    gates floored at G_FLOOR as the kernels take them. Weighted outer sums over time (states.py), not the chunked
    op: this first pass is what later ranks wait for."""
    q, k, v, beta = given["q"], given["k"], given["v"], given.get("beta")
    B, T, H, _ = q.shape
    if beta is None:  # the hooks of beta = 1
        beta = torch.ones(B, T, H, device=q.device)
    key_scale, value_scale = BetaScales.apply(beta, hooks)
    g_s, g_h = runtime._gates(given.get("g"), given.get("gk"), q)
    g_h = g_s if g_h is None else g_h
    starts = start if start is not None else (None, None)
    ends = []
    for gate, right, right_scale, first in ((g_h, k, key_scale, starts[0]), (g_s, v, value_scale, starts[1])):
        gate = gate.float().clamp_min(G_FLOOR)
        suffix = _cumsum_over_time(gate.flip(1)).flip(1)  # g_t + ... + g_T
        after = torch.cat([suffix[:, 1:], torch.zeros_like(suffix[:, :1])], 1)  # g_(t+1) + ... + g_T
        end = outer_sum(k, right, torch.exp(after) * key_scale * right_scale)
        if first is not None:
            end = end + torch.exp(suffix[:, 0]).reshape(B, H, 1, 1) * first.float()
        ends.append(end)
    return ends


def _log_decays(runtime: Any, given: dict) -> list[torch.Tensor]:
    """Each state's log decay over this shard, shaped to multiply the state [B, H, K, *] (fp32)."""
    q = given["q"]
    B, _, H, _ = q.shape
    if isinstance(runtime, GKAOp):
        g_s, g_h = runtime._gates(given.get("g"), given.get("gk"), q)
        g_h = g_s if g_h is None else g_h
        return [g.float().sum(1).reshape(B, H, 1, 1) for g in (g_h, g_s)]
    return [_linear_gates(runtime, given).sum(1).reshape(B, H, -1, 1)]  # per head or, per key, [B, H, K, 1]


def _fold(earlier: Any, state_shapes: list, decay_shapes: list) -> list[torch.Tensor]:
    """The states entering this rank's shard from the earlier ranks' gathered (F_j, G_j): S = F_0, then
    S = exp(G_j) S + F_j (rank 0's F_0 already starts from the given initial state)."""
    incoming: list[torch.Tensor] = []
    for packed in earlier:
        parts = list(packed.split([int(torch.Size(shape).numel()) for shape in (*state_shapes, *decay_shapes)]))
        ends = [p.reshape(shape) for p, shape in zip(parts, state_shapes, strict=False)]
        decays = [p.reshape(shape) for p, shape in zip(parts[len(state_shapes):], decay_shapes, strict=True)]
        if not incoming:
            incoming = ends
        else:
            incoming = [torch.exp(d) * s + e for s, e, d in zip(incoming, ends, decays, strict=True)]
    return incoming


class _Tie(torch.autograd.Function):
    """o unchanged; the gathered tensors get zero gradients from it, so that the gather's backward (a collective)
    runs on every rank, including rank 0, whose output does not read them."""

    @staticmethod
    def forward(ctx: Any, o: torch.Tensor, *gathered: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.shapes = [(g.shape, g.dtype, g.device) for g in gathered]
        return o.view_as(o)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        return (grad, *(torch.zeros(s, dtype=d, device=dev) for s, d, dev in ctx.shapes))


def _check_shards(runtime: Any, given: dict, rank: int, world: int, group: Any) -> None:
    """Every rank's tensors against rank 0's (one all_gather of their shapes and dtypes): the same axes but time,
    the same dtypes, at least one token. A mismatch raises the same CallError on every rank, naming the rank, the
    tensor and the axis, instead of a collective that hangs or a wrong state."""
    names = [n for n in given if n != "initial_state"]  # every argument: the records have one length on all ranks
    record = []
    for n in names:
        t = given[n]
        if not isinstance(t, torch.Tensor):
            record += [-1, -1, *[-1] * _SHAPE_SLOTS]
            continue
        dims = list(t.shape)[:_SHAPE_SLOTS]
        code = _DTYPES.index(t.dtype) if t.dtype in _DTYPES else len(_DTYPES)
        record += [t.dim(), code, *dims, *[-1] * (_SHAPE_SLOTS - len(dims))]
    table = _gather_records(record, _host_group(group))
    width = 2 + _SHAPE_SLOTS
    for r in range(world):
        for i, n in enumerate(names):
            ref, got = table[0][i * width:(i + 1) * width], table[r][i * width:(i + 1) * width]
            axes = runtime.roles.axes.get(n, ())  # chunk's argument names are the roles
            if (got[0] < 0) != (ref[0] < 0):
                kinds = ["not a tensor" if row[0] < 0 else "a tensor" for row in (got, ref)]
                raise CallError(None, detail=f"rank {r}: {n} is {kinds[0]}, rank 0's is {kinds[1]} "
                                "(sequence-parallel shards must agree)")
            if got[1] != ref[1]:
                raise CallError(None, detail=f"rank {r}: {n} has dtype {_dtype_name(got[1])}, rank 0's "
                                f"{_dtype_name(ref[1])} (sequence-parallel shards must agree)")
            for axis in range(max(got[0], ref[0])):
                size, want = got[2 + axis], ref[2 + axis]
                if n == "q" and axis == 1 and size < 1:
                    raise CallError(None, detail=f"rank {r}: {n} holds no tokens (axis "
                                    f"'{_axis_name(axes, axis)}'); every rank needs a shard")
                if got[0] != ref[0] or (axis != 1 and size != want):
                    raise CallError(None, detail=f"rank {r}: {n} has axis '{_axis_name(axes, axis)}' of size "
                                    f"{size}, rank 0's {want} (shards differ in time only)")


def _host_group(group: Any) -> Any:
    """A group of `group`'s ranks that carries CPU tensors: itself where its backend has gloo, else a gloo group
    made once per group (only its ranks take part: use_local_synchronization; a group made again after
    destroy_process_group gets its own), with `group`'s timeout where torch shows it, so that a rank that never
    arrives fails the others as the group would."""
    group = group if group is not None else dist.group.WORLD
    if "gloo" in str(dist.get_backend(group)):
        return group
    made = _HOST_GROUPS.get(id(group))
    if made is None or made[0] is not group:
        ranks = dist.get_process_group_ranks(group)
        timeout = None
        for device in ("cuda", "cpu"):
            try:  # (private: the backend's options; absent, torch's default timeout)
                timeout = group._get_backend(torch.device(device)).options._timeout
                break
            except (AttributeError, RuntimeError):
                continue
        made = (group, dist.new_group(ranks, timeout=timeout, backend="gloo", use_local_synchronization=True))
        _HOST_GROUPS[id(group)] = made
    return made[1]


def _gather_records(record: list[int], group: Any) -> list[list[int]]:
    """Every rank's record (int64, one length on every rank), in rank order, gathered on the host over `group`."""
    return _post_records(record, group)()


def _post_records(record: list[int], group: Any) -> Callable[[], list[list[int]]]:
    """_gather_records, posted: returns what awaits the gather (gloo runs it on its own threads meanwhile)."""
    mine = torch.tensor(record, dtype=torch.int64)
    rows = torch.empty(dist.get_world_size(group) * len(record), dtype=torch.int64)
    work = gather_into(rows, mine, group=group, async_op=True)

    def result() -> list[list[int]]:
        work.wait()
        return rows.view(-1, len(record)).tolist()

    return result


def _axis_name(axes: tuple, axis: int) -> str:
    return axes[axis] if axis < len(axes) else str(axis)


def _dtype_name(code: int) -> str:
    return str(_DTYPES[code]) if code < len(_DTYPES) else "a dtype the op refuses"
