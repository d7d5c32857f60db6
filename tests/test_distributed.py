"""Sequence-parallel recurrences (ncd/distributed.py) on spawned gloo process groups of 2 and 4 ranks, kernels in
the interpreter: each rank's output, final state and every gradient of its shard equal the single-process op's
on the whole sequence (fp32, 1e-5 relative), with uneven shards; a rank with a wrong shard fails on every rank,
naming the rank, the tensor and the axis."""

from __future__ import annotations

import datetime
import os
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

K, V, H, B = 16, 8, 2, 2


def _load(name: str, cache: str):
    import ncd
    from ncd.ops import shipped_spec

    op = ncd.load(shipped_spec(name), cache_dir=cache, sizes={"kdim": K, "vdim": V})
    return op.with_config(dot_precision="ieee") if name.startswith("gka") else op


def _inputs(name: str, T: int) -> dict:
    gen = torch.Generator().manual_seed(7)
    x = {"q": torch.randn(B, T, H, K, generator=gen),
         "k": F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1),
         "v": torch.randn(B, T, H, V, generator=gen)}
    if name == "gla":
        x["g"] = F.logsigmoid(torch.randn(B, T, H, K, generator=gen) + 2.0)
    elif name == "retnet":
        x["g"] = F.logsigmoid(torch.randn(H, generator=gen) + 2.0)
    elif name == "delta_rule":  # no gate; a tensor scale, whose gradient sums over the ranks
        x["scale"] = torch.tensor(0.7)
    else:
        x["g"] = F.logsigmoid(torch.randn(B, T, H, generator=gen) + 2.0)
    if name.startswith("gka") or name.endswith("delta_rule"):
        x["beta"] = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    if name.startswith("gka"):
        x["alpha"] = torch.sigmoid(torch.randn(B, T, H, generator=gen))
        a = torch.randn(B, H, K, K, generator=gen) * 0.3
        x["initial_state"] = (a @ a.transpose(-1, -2), torch.randn(B, H, K, V, generator=gen) * 0.1)
    else:
        x["initial_state"] = torch.randn(B, H, K, V, generator=gen) * 0.1
    return x


def _leaves(x: dict) -> dict:
    def leaf(t):
        if isinstance(t, tuple):
            return tuple(leaf(s) for s in t)
        return t.detach().clone().requires_grad_()
    return {n: leaf(t) for n, t in x.items()}


def _flat(x: dict) -> list:
    out = []
    for n in sorted(x):
        out += [(f"{n}[{i}]", t) for i, t in enumerate(x[n])] if isinstance(x[n], tuple) else [(n, x[n])]
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _worker(rank: int, world: int, cases: list, init: str, cache: str, errors: str) -> None:
    """Every case (spec, shard lengths) in one process group; each failure reported, the others still run."""
    try:
        os.environ["TRITON_INTERPRET"] = "1"
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
        failures = []
        for name, shards in cases:
            try:
                _compare(rank, world, name, shards, cache)
            except AssertionError as failure:
                failures.append(f"{name}: {failure}")
        dist.barrier()
        dist.destroy_process_group()
        assert not failures, "\n".join(failures)
    except BaseException:
        Path(errors, f"rank{rank}.txt").write_text(traceback.format_exc())
        raise


def _compare(rank: int, world: int, name: str, shards: list, cache: str) -> None:
    from ncd.distributed import sequence_parallel_chunk

    op = _load(name, cache)
    T = sum(shards)
    lo, hi = sum(shards[:rank]), sum(shards[:rank + 1])
    full = _inputs(name, T)
    gen = torch.Generator().manual_seed(11)
    do = torch.randn(B, T, H, V, generator=gen)
    dfin = [torch.randn(s.shape, generator=gen) for s in
            (full["initial_state"] if isinstance(full["initial_state"], tuple) else (full["initial_state"],))]
    kw = {"chunk_size": 16}
    if name.startswith("gka"):
        kw["num_iter"] = 5

    def call(fn, x, **extra):
        args = {n: t for n, t in x.items() if n != "alpha"}
        if "alpha" in x:
            extra["alpha"] = x["alpha"]
        return fn(**args, output_final_state=True, **kw, **extra)

    def loss(o, final, o_part, final_part):
        final = final if isinstance(final, tuple) else (final,)
        total = (o * o_part).sum()
        return total + sum((f * d).sum() for f, d in zip(final, final_part, strict=True))

    ref_x = _leaves(full)  # the single-process op on the whole sequence
    o_ref, final_ref = call(op.module.chunk, ref_x)
    loss(o_ref, final_ref, do, dfin).backward()

    sharded = {n: (t[:, lo:hi] if isinstance(t, torch.Tensor) and t.dim() > 1 else t) for n, t in full.items()}
    x = _leaves(sharded)
    runtime, runs = op.module._OP, []
    kernel_op = runtime.op
    runtime.op = lambda *a: runs.append(a[2].shape[-1]) or kernel_op(*a)  # (the values' width of each run)
    try:
        o, final = call(lambda **a: sequence_parallel_chunk(op, **a), x)
    finally:
        runtime.op = kernel_op
    if name.endswith("delta_rule"):  # each shard runs once: rank 0 as it is, the others widened by the state map
        assert runs == [V if rank == 0 else V + K], runs
    last = rank == world - 1
    # the loss of the whole sequence, split over the ranks: the final-state term on the last rank only
    part = loss(o, final, do[:, lo:hi], dfin) if last else (o * do[:, lo:hi]).sum()
    part.backward()

    assert o.shape == (B, hi - lo, H, V)
    errors = {"o": _rel(o, o_ref[:, lo:hi])}
    if last:
        got = final if isinstance(final, tuple) else (final,)
        want = final_ref if isinstance(final_ref, tuple) else (final_ref,)
        errors.update({f"final[{i}]": _rel(a, b) for i, (a, b) in enumerate(zip(got, want, strict=True))})
    for (n, mine), (_, ref) in zip(_flat(x), _flat(ref_x), strict=True):
        grad = mine.grad if mine.grad is not None else torch.zeros_like(mine)
        if n.startswith("initial_state"):
            if rank == 0:
                errors[f"d{n}"] = _rel(grad, ref.grad)
            continue
        if mine.dim() > 1:  # a time shard: its rows of the whole sequence's gradient
            errors[f"d{n}"] = _rel(grad, ref.grad[:, lo:hi])
        else:  # shared by every shard (RetNet's decay): the ranks' gradients sum to it
            dist.all_reduce(grad)
            errors[f"d{n}"] = _rel(grad, ref.grad)
    bad = {n: e for n, e in errors.items() if not e < 1e-5}
    assert not bad, f"rank {rank} of {world}, shards {shards}: {bad} (all: {errors})"


def _spawn(tmp_path: Path, world: int, cases: list, target=_worker) -> None:
    errors = tmp_path / "errors"
    errors.mkdir()
    init = f"file://{tmp_path / 'pg'}"
    try:
        mp.spawn(target, args=(world, cases, init, str(tmp_path / "cache"), str(errors)), nprocs=world)
    except Exception as e:
        reports = "\n".join(p.read_text() for p in sorted(errors.iterdir()))
        raise AssertionError(f"a rank failed:\n{reports}") from e


# one process group per rank count (spawning and importing cost more than a case)
CASES = {2: [("simple_gla", [13, 8]), ("retnet", [7, 18]), ("gka", [19, 6]), ("gka_ungated_covariance", [11, 14]),
             ("delta_rule", [9, 14])],
         4: [("gla", [5, 9, 3, 11]), ("gated_delta_rule", [5, 9, 3, 11])]}


@pytest.mark.parametrize("world", sorted(CASES))
def test_sequence_parallel_equals_the_single_process_op(tmp_path, world):
    """Forward, the final state and every gradient, per rank, against the whole-sequence op: scalar, per-key and
    constant decays, and Gated KalmaNet's two states (its solve reads the full prefix state); the gated delta
    rule, whose shard maps are K x K matrices (K 16 > V 8: the map wider than the values), folded over 3 ranks;
    the delta rule without a gate, with a tensor scale;
    shards uneven and across chunk boundaries (chunk 16)."""
    _spawn(tmp_path, world, CASES[world])


def _bad_shard_worker(rank: int, world: int, cases: list, init: str, cache: str, errors: str) -> None:
    from ncd.distributed import sequence_parallel_chunk
    from ncd.errors import CallError

    os.environ["TRITON_INTERPRET"] = "1"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    name = cases[0][0]
    op = _load(name, cache)
    x = _inputs(name, 6)
    x.pop("initial_state")
    cases = [("k", x["k"][:, :, :1], r"rank 1: k has axis 'head' of size 1, rank 0's 2"),
             ("v", x["v"].double(), r"rank 1: v has dtype torch\.float64, rank 0's torch\.float32"),
             ("scale", torch.tensor(0.5), r"rank 1: scale is a tensor, rank 0's is not a tensor")]
    for bad, value, message in cases:
        given = dict(x, **{bad: value}) if rank == 1 else x
        with pytest.raises(CallError, match=message):
            sequence_parallel_chunk(op, **given, chunk_size=16)
    dist.destroy_process_group()


def _initial_state_only_worker(rank: int, world: int, cases: list, init: str, cache: str, errors: str) -> None:
    from ncd.distributed import sequence_parallel_chunk

    try:
        os.environ["TRITON_INTERPRET"] = "1"
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        for name, shards in cases:
            op = _load(name, cache)
            full = _inputs(name, sum(shards))
            s0 = full.pop("initial_state").requires_grad_()
            o_ref, _ = op.module.chunk(**full, initial_state=s0, chunk_size=16)
            do = torch.randn(o_ref.shape, generator=torch.Generator().manual_seed(3))
            (want,) = torch.autograd.grad(o_ref, s0, do)
            lo, hi = sum(shards[:rank]), sum(shards[:rank + 1])
            mine = s0.detach().clone().requires_grad_()
            o, _ = sequence_parallel_chunk(op, **{n: t[:, lo:hi] for n, t in full.items()}, initial_state=mine,
                                           chunk_size=16)
            (o * do[:, lo:hi]).sum().backward()  # rank 1: nothing of its own takes a gradient
            if rank == 0:
                assert _rel(mine.grad, want) < 1e-5, (name, _rel(mine.grad, want))
        dist.destroy_process_group()
    except BaseException:
        Path(errors, f"rank{rank}.txt").write_text(traceback.format_exc())
        raise


def test_an_initial_state_alone_takes_its_gradient_through_every_ranks_backward(tmp_path):
    """Only rank 0's initial state requires a gradient: the other ranks' outputs still reach the gather, so their
    backward runs its collective (it raised 'does not require grad' on rank 1, and rank 0 waited)."""
    _spawn(tmp_path, 2, [("simple_gla", [9, 11]), ("gated_delta_rule", [9, 11])],
           target=_initial_state_only_worker)


def test_a_wrong_shard_fails_on_every_rank_naming_rank_tensor_and_axis(tmp_path):
    _spawn(tmp_path, 2, [("simple_gla", [6, 6])], target=_bad_shard_worker)


def test_packed_sequences_are_refused_before_any_collective(tmp_path):
    from ncd.distributed import sequence_parallel_chunk
    from ncd.errors import CallError

    q = torch.randn(1, 4, H, K)
    gla = _load("simple_gla", str(tmp_path))
    with pytest.raises(CallError, match="cu_seqlens None"):
        sequence_parallel_chunk(gla, q, q, torch.randn(1, 4, H, V), torch.zeros(1, 4, H),
                                cu_seqlens=torch.tensor([0, 4]))


@pytest.fixture
def nan_empty(monkeypatch):
    """torch.empty poisoned with NaN, so an output element a kernel leaves unwritten fails the comparison."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        out = empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(torch, "empty", poisoned)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weighted_outer_sums_and_projections_equal_float64_with_every_gradient(monkeypatch, nan_empty, dtype):
    """states.py's kernels against float64 einsums: outer_sum(x, y, a) = sum_t a_t x_t y_t^T over several splits
    of time and project(x, m, a) = a_t x_t m, forward and the gradients of every input, at sizes no tile divides
    (T 77 in 3 splits of 26 tokens, K 20, V 37 in tiles of 32)."""
    from ncd.families.recurrence import states

    monkeypatch.setattr(states, "SPLIT_TOKENS", 32)
    gen = torch.Generator().manual_seed(5)
    B, T, H, K, V = 2, 77, 3, 20, 37
    x, y = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, V, generator=gen)
    a, m = torch.rand(B, T, H, generator=gen), torch.randn(B, H, K, V, generator=gen)

    def close(got, want, bound):
        got = got.detach()
        assert torch.isfinite(got).all()
        assert float((got.double() - want).norm() / want.norm()) < bound

    def check(fn, reference, inputs, d_out):
        leaves = [(t.to(dtype) if i < 2 and t.dim() == 4 else t).clone().requires_grad_() for i, t in enumerate(inputs)]
        exact = [t.detach().double().requires_grad_() for t in leaves]
        out, want = fn(*leaves), reference(*exact)
        close(out, want, 1e-6)  # fp32 out: products of the (rounded) inputs as fp32 ones
        out.backward(d_out)
        want.backward(d_out.double())
        for got, ref in zip(leaves, exact, strict=True):  # a gradient comes back in its input's dtype
            close(got.grad, ref.grad, 1e-6 if got.dtype == torch.float32 else 2 ** -8)

    check(states.outer_sum, lambda x, y, a: torch.einsum("bthk,bthv,bth->bhkv", x, y, a), (x, y, a),
          torch.randn(B, H, K, V, generator=gen))
    check(states.project, lambda x, m, a: torch.einsum("bthk,bhkv,bth->bthv", x, m, a), (x, m, a),
          torch.randn(B, T, H, V, generator=gen))
