"""Context-parallel attention (ncd/families/attention/ring.py) on spawned gloo process groups of 2 and 4 ranks,
kernels in the interpreter: each rank's output and the gradients of its shard equal the single-process op's on the
whole sequence (fp32, 1e-5 relative). Causal specs in the zigzag layout with chunks of odd length; a non-causal
spec with uneven shards; GQA with a per-key weight; score and mask modifiers (positions, per-key tensors that travel,
call-time range tables, a table read at key - query); a wrong shard fails on every rank naming rank, tensor, axis."""

from __future__ import annotations

import datetime
import os
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

D, B, H = 16, 1, 2


def _load(name: str, cache: str):
    """The op; "+factorized": with its factorized form forced (at these sizes the op would stream); "+lse": called
    with return_lse."""
    import ncd
    from ncd.ops import shipped_spec

    base, _, form = name.partition("+")
    path = shipped_spec(base) if base not in LOCAL_SPECS else Path(cache, f"{base}.ncd")
    if base in LOCAL_SPECS and not path.exists():  # (each rank writes it whole, then renames)
        Path(cache).mkdir(parents=True, exist_ok=True)
        Path(cache, f"{base}.{os.getpid()}").write_text(LOCAL_SPECS[base])
        os.replace(Path(cache, f"{base}.{os.getpid()}"), path)
    op = ncd.load(path, cache_dir=cache, sizes={"dim": D})
    return op.with_config(factorize="always") if form == "factorized" else op


def _inputs(name: str, n: int) -> dict:
    name, _, form = name.partition("+")
    gen = torch.Generator().manual_seed(5)
    kv_heads = 1 if name == "causal_gqa_spherical" else H
    # the factorized form batches a rank's two segments: views of the shard at batch 1 (GQA's case), copies at 2
    b = 2 if form == "factorized" and name != "causal_gqa_spherical" else B
    x = {"Q": torch.randn(b, H, n, D, generator=gen), "K": torch.randn(b, kv_heads, n, D, generator=gen),
         "V": torch.randn(b, kv_heads, n, D, generator=gen)}
    if name == "causal_gqa_spherical":  # Q [batch head query dim], head = kvhead * qgroup; a multiplicity per key
        x["M"] = torch.rand(b, n, generator=gen) + 0.5
    if name == "causal_softmax_attention":  # a tensor scale takes a gradient (spherical's would be 0: it cancels)
        x["scale"] = torch.tensor(0.3)
    if name == "sink_softmax":  # a sink logit per head
        x["sink"] = torch.randn(H, generator=gen)
    if name == "alibi_softmax":  # a slope per head, with its gradient
        x["slope"] = torch.rand(H, generator=gen)
    if name == "sliding_window_softmax":
        x["window"] = 5
    if name == "document_softmax":  # documents of 1 to 8 tokens; the key ids travel with the keys
        ids = (torch.rand(b, n, generator=gen) < 0.2).cumsum(1).to(torch.int32)
        x["q_doc"], x["k_doc"] = ids, ids.clone()
    if name == "t5_log_bucket_softmax":  # a bucket table read at key - query, with its gradient
        x["table"] = torch.randn(H, 32, generator=gen)
    if name == "biased_softmax":  # [head query key]: each rank's queries against every key, with its gradient
        x["bias"] = torch.randn(H, n, n, generator=gen)
    if name in ("forgetting_softmax", "windowed_forgetting"):  # cumulative log forget gates, read at both ends
        c = torch.nn.functional.logsigmoid(torch.randn(b, H, n, generator=gen) + 2.0).cumsum(-1)
        x["fq"], x["fk"] = c, c.clone()
    return x


SHARED = ("scale", "sink", "slope", "window", "table")  # read whole by every shard
CANCELS = {"fq": "fk"}  # fq's gradient is zero in exact arithmetic: judged against the size of fk's

# FoX with a sliding window: a key-side tensor with a gradient where the halo exchange moves the keys
LOCAL_SPECS = {"windowed_forgetting": """spec windowed_forgetting
axis batch, head, query, key
axis dim = 128
in  Q[batch head query dim] : bf16
in  K[batch head key dim]   : bf16
in  V[batch head key dim]   : bf16
in  fq[batch head query]    : f32
in  fk[batch head key]      : f32
in  window : i32 = 5
S[batch head query key] = (Q . K over dim) / sqrt(size(dim)) + (fq - fk)
A[batch head query key] = normalize(S, over key, a1(x) = exp(x), a2(x) = exp(x), b(z) = z,
                                    mask = key <= query and key > query - window)
out O[batch head query dim] = A . V over key
"""}


def _seq_dim(name: str, t: str) -> int:
    return {"Q": 2, "K": 2, "V": 2, "M": 1, "q_doc": 1, "k_doc": 1, "bias": 1, "fq": 2, "fk": 2}[t]


def _zigzag(op) -> bool:
    """The layout the op takes: zigzag where it is causal or a mask hides pairs (ring.py)."""
    kernels = op.module.KERNELS
    return kernels.causal or kernels.mask_hides


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
                failures.append(str(failure))
        dist.barrier()
        dist.destroy_process_group()
        assert not failures, "\n".join(failures)
    except BaseException:
        Path(errors, f"rank{rank}.txt").write_text(traceback.format_exc())
        raise


def _shard(name: str, full: dict, rank: int, world: int, shards: list, causal: bool) -> dict:
    from ncd.distributed import zigzag_shard

    lo, hi = sum(shards[:rank]), sum(shards[:rank + 1])
    out = {}
    for n, t in full.items():
        if n in SHARED:
            out[n] = t
        elif causal:
            out[n] = zigzag_shard(t, _seq_dim(name, n), rank, world)
        else:
            out[n] = t.narrow(_seq_dim(name, n), lo, hi - lo)
    return out


def _compare(rank: int, world: int, name: str, shards: list, cache: str) -> None:
    from ncd.distributed import context_parallel_attention

    op = _load(name, cache)
    causal = _zigzag(op)
    from ncd.families.attention import ring

    calls, halos = [], []
    original, halo_forward = ring.FactorizedContextParallel.apply, ring.halo_forward
    ring.FactorizedContextParallel.apply = lambda *a: calls.append(1) or original(*a)  # which form ran
    ring.halo_forward = lambda *a: halos.append(1) or halo_forward(*a)
    full = _inputs(name, sum(shards))
    with_lse = name.endswith("+lse")
    weight_grad = "+" not in name  # the ring takes the per-key weight's gradient (the factorized form refuses it)
    def leaf(n, t):
        return t if not isinstance(t, torch.Tensor) or not t.is_floating_point() else \
            t.requires_grad_(n != "M" or weight_grad)

    ref = {n: leaf(n, t.clone() if isinstance(t, torch.Tensor) else t) for n, t in full.items()}
    o_ref, lse_ref = op(**ref, return_lse=True) if with_lse else (op(**ref), None)
    gen = torch.Generator().manual_seed(9)
    do = torch.randn(o_ref.shape, generator=gen)
    dlse = torch.randn(o_ref.shape[:3], generator=gen)
    ((o_ref * do).sum() + ((lse_ref * dlse).sum() if with_lse else 0)).backward()

    mine = {n: leaf(n, t.detach().clone() if isinstance(t, torch.Tensor) else t)
            for n, t in _shard(name, full, rank, world, shards, causal).items()}
    try:
        if with_lse:
            o, lse = context_parallel_attention(op, **mine, return_lse=True)
        else:
            o = context_parallel_attention(op, **mine)
    finally:
        ring.FactorizedContextParallel.apply, ring.halo_forward = original, halo_forward
    assert bool(calls) == ("+factorized" in name), f"{name}: the wrong form ran (factorized: {bool(calls)})"
    local = name in ("sliding_window_softmax", "windowed_forgetting")  # a window of 5 over chunks of 9: 4 keys of
    # each earlier chunk
    assert bool(halos) == local, f"{name}: the halo exchange ran: {bool(halos)}, expected {local}"
    do_mine = _shard(name, {"Q": do}, rank, world, shards, causal)["Q"]
    loss = (o * do_mine).sum()
    errors = {"o": _rel(o, _shard(name, {"Q": o_ref}, rank, world, shards, causal)["Q"])}
    if with_lse:  # lse [batch head query]: sharded along its last axis as Q is along the query axis
        rows = _shard(name, {"Q": torch.stack([lse_ref.detach(), dlse], -1)}, rank, world, shards, causal)["Q"]
        loss = loss + (lse * rows[..., 1]).sum()
        errors["lse"] = _rel(lse, rows[..., 0])
    loss.backward()
    assert o.shape == do_mine.shape
    for n, t in mine.items():
        if (n == "M" and not weight_grad) or not isinstance(t, torch.Tensor) or not t.is_floating_point():
            continue
        if n in SHARED:  # read by every shard: the ranks' gradients sum to it
            grad = t.grad.clone()
            dist.all_reduce(grad)
            errors[f"d{n}"] = _rel(grad, ref[n].grad)
        elif n in CANCELS:  # rounding both sides, at the size of the terms that cancel
            want = _shard(name, {n: ref[n].grad}, rank, world, shards, causal)[n]
            errors[f"d{n}"] = float((t.grad - want).norm() / ref[CANCELS[n]].grad.norm())
        else:
            errors[f"d{n}"] = _rel(t.grad, _shard(name, {n: ref[n].grad}, rank, world, shards, causal)[n])
    bad = {n: e for n, e in errors.items() if not e < 1e-5}
    assert not bad, f"{name}, rank {rank} of {world}, shards {shards}: {bad} (all: {errors})"


def _spawn(tmp_path: Path, world: int, cases: list, target=_worker) -> None:
    errors = tmp_path / "errors"
    errors.mkdir()
    init = f"file://{tmp_path / 'pg'}"
    try:
        mp.spawn(target, args=(world, cases, init, str(tmp_path / "cache"), str(errors)), nprocs=world)
    except Exception as e:
        reports = "\n".join(p.read_text() for p in sorted(errors.iterdir()))
        raise AssertionError(f"a rank failed:\n{reports}") from e


# one process group per rank count (spawning and compiling cost more than a case)
CASES = {
    2: [("causal_softmax_attention", [10, 10]), ("signed_l1_attention", [7, 12]), ("causal_gqa_spherical", [14, 14]),
        ("causal_spherical_attention+factorized", [38, 38]), ("sink_softmax", [10, 10]),
        ("softmax_plus_one", [7, 12]), ("alibi_softmax", [10, 10]), ("document_softmax", [14, 14]),
        ("t5_log_bucket_softmax", [9, 14]), ("biased_softmax", [7, 12]), ("forgetting_softmax", [10, 10])],
    3: [("spherical_attention+factorized", [9, 20, 13]), ("causal_softmax_attention+lse", [6, 6, 6]),
        ("sliding_window_softmax", [18, 18, 18]), ("windowed_forgetting", [18, 18, 18])],
    4: [("causal_spherical_attention", [6, 6, 6, 6]), ("causal_gqa_spherical+factorized", [10, 10, 10, 10])],
}


@pytest.mark.parametrize("world", sorted(CASES))
def test_context_parallel_equals_the_single_process_op(tmp_path, world):
    """Output and every gradient per rank against the whole-sequence op. The ring: the running max's merge
    (softmax, and its scale's gradient summed over the ranks), a nonlinear normaliser (spherical's sqrt), a
    non-causal spec on uneven shards, GQA with a per-key weight that travels with the keys; causal chunks of odd
    length (5, 3, 7). The factorized form's states: zigzag chunks of 19 (past the interpreter's 16-key chunk),
    uneven non-causal shards, GQA with a weight. A sink merged once (a per-head logit whose gradient sums over the
    ranks; softmax-plus-one's constant), and the row statistic (return_lse) with its own gradient. A tensor over
    keys whose gradient travels home with dK/dV: FoX's gate sums on the ring, and with a window, by the halo."""
    _spawn(tmp_path, world, CASES[world])


def _bad_shard_worker(rank: int, world: int, cases: list, init: str, cache: str, errors: str) -> None:
    try:
        _bad_shards(rank, world, cases[0][0], init, cache)
    except BaseException:
        Path(errors, f"rank{rank}.txt").write_text(traceback.format_exc())
        raise


def _bad_shards(rank: int, world: int, name: str, init: str, cache: str) -> None:
    from ncd.distributed import context_parallel_attention, zigzag_shard
    from ncd.errors import CallError

    os.environ["TRITON_INTERPRET"] = "1"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    def cases(x: dict) -> list:
        half = {n: t.to(torch.bfloat16) for n, t in x.items()}
        return [({"K": x["K"][:, :1]}, r"rank 1: K: axis 'head' has size 1, but Q has 2"),  # the op's own check
                ({"V": x["V"].double()}, r"rank 1: V has dtype torch\.float64; expected"),
                (half, r"rank 1: Q has dtype torch\.bfloat16, rank 0's torch\.float32"),
                ({n: x[n].repeat(1, 1, 2, 1)[:, :, :10] for n in "QKV"},
                 r"rank 1: Q has axis 'query' of size 10, rank 0's 6: causal context parallelism takes two equal"),
                ({n: x[n][:, :1] for n in "QKV"}, r"rank 1: Q has axis 'head' of size 1, rank 0's 2 \(shards differ")]

    op, x = _load(name, cache), _inputs(name, 6)
    for bad, message in cases(x):
        given = dict(x, **bad) if rank == 1 else x
        with pytest.raises(CallError, match=message):
            context_parallel_attention(op, **given)
    # the factorized form: the check's gather runs while the first scan is queued, awaited before the first
    # collective; the same wrong shards fail on every rank there too
    from ncd import distributed
    from ncd.families.attention.kernel_chunked import FactorizedAttentionKernels

    factorized, y = _load("causal_spherical_attention+factorized", cache), _inputs("causal_spherical_attention", 6)
    order: list[str] = []
    key_states, post = FactorizedAttentionKernels.key_states, distributed._post_records
    FactorizedAttentionKernels.key_states = lambda *a, **k: order.append("scan") or key_states(*a, **k)
    distributed._post_records = lambda *a: (lambda wait: lambda: order.append("awaited") or wait())(post(*a))
    try:
        for bad, message in cases(y):
            given = dict(y, **bad) if rank == 1 else y
            with pytest.raises(CallError, match=message):
                context_parallel_attention(factorized, **given)
        for name in ("causal_spherical_attention", "spherical_attention"):  # (zigzag shards; 5 and 7 positions)
            op, whole = _load(f"{name}+factorized", cache), _inputs(name, 12)
            mine = {n: zigzag_shard(t, 2, rank, world) if "causal" in name else t[:, :, (0, 5)[rank]:(5, 12)[rank]]
                    for n, t in whole.items()}
            order.clear()
            got = context_parallel_attention(op, **mine)
            assert order == ["scan", "awaited"], (name, order)
            want = op(**whole)
            want = zigzag_shard(want, 2, rank, world) if "causal" in name else want[:, :, (0, 5)[rank]:(5, 12)[rank]]
            assert _rel(got, want) < 1e-5, (name, _rel(got, want))
    finally:
        FactorizedAttentionKernels.key_states, distributed._post_records = key_states, post
    with pytest.raises(CallError, match="return_lse under context parallelism runs on the ring"):
        context_parallel_attention(_load("causal_spherical_attention+factorized", cache), **x, return_lse=True)
    # what the ring does not carry is refused before any collective, on each rank alone
    qkv = {n: torch.randn(B, H, 4, D) for n in "QKV"}
    with pytest.raises(CallError, match=r"rank 0: bias has axis 'key' of size 4; under context parallelism a tensor "
                       r"over both 'query' and 'key' holds this rank's 'query' positions against every 'key' "
                       r"position: 8"):
        context_parallel_attention(_load("biased_softmax", cache), **qkv, bias=torch.randn(H, 4, 4))
    ids = torch.zeros(B, 4, dtype=torch.int32)
    with pytest.raises(CallError, match="masked context parallelism takes two equal chunks"):  # uneven, masked
        context_parallel_attention(_load("document_softmax", cache),
                                   **{n: t[:, :, :3 + rank] for n, t in qkv.items()}, q_doc=ids[:, :3 + rank],
                                   k_doc=ids[:, :3 + rank])
    # a scalar that the mask reads differs: refused; two windows in turn: each call's own plan (cached by window)
    window_op = _load("sliding_window_softmax", cache)
    whole = {n: torch.randn(B, H, 8, D, generator=torch.Generator().manual_seed(3)) for n in "QKV"}
    mine = {n: zigzag_shard(t, 2, rank, world) for n, t in whole.items()}
    with pytest.raises(CallError, match=r"rank 1: window is 3, rank 0's 2 \(a scalar that the hooks read is alike"):
        context_parallel_attention(window_op, **mine, window=2 + rank)
    for window in (2, 3, 2):
        got = context_parallel_attention(window_op, **mine, window=window)
        want = zigzag_shard(window_op(**whole, window=window), 2, rank, world)
        assert _rel(got, want) < 1e-5, f"window {window}: {_rel(got, want)}"
    # a plan is made once where the mask reads no tensor (FoX's gate sums feed the score only), every call where
    # it does (document ids); the second FoX call runs from the cached plan and still equals the op
    from ncd.families.attention import ring

    reach, counted = ring.RingModifiers.reach, []
    ring.RingModifiers.reach = lambda *a: counted.append(1) or reach(*a)
    try:
        for name in ("forgetting_softmax", "document_softmax"):
            op, x = _load(name, cache), _inputs(name, 8)
            mine = _shard(name, x, rank, world, [8, 8], True)
            runs = []
            for _ in range(2):
                counted.clear()
                got = context_parallel_attention(op, **mine)
                runs.append(len(counted))
                assert _rel(got, zigzag_shard(op(**x), 2, rank, world)) < 1e-5
            assert runs[0] > 0 and runs[1] == (runs[0] if name == "document_softmax" else 0), (name, runs)
    finally:
        ring.RingModifiers.reach = reach
    # a group without gloo (NCCL on the GPU) sends the check's records over a gloo group of its ranks, made once:
    # the check then never reads a device tensor (which would wait for the device's queue)
    from ncd import distributed

    backend = dist.get_backend
    dist.get_backend = lambda group=None: "nccl"
    shards = {n: zigzag_shard(t, 2, rank, world) for n, t in whole.items()}
    try:
        for _ in range(2):
            got = context_parallel_attention(window_op, **shards, window=2)
            assert _rel(got, zigzag_shard(window_op(**whole, window=2), 2, rank, world)) < 1e-5
        with pytest.raises(CallError, match=r"rank 1: V has dtype torch\.float64; expected"):
            bad = dict(shards, V=shards["V"].double()) if rank == 1 else shards
            context_parallel_attention(window_op, **bad, window=2)
        assert [made[0] for made in distributed._HOST_GROUPS.values()] == [dist.group.WORLD]
        host = distributed._host_group(None)
        assert host is not dist.group.WORLD and dist.get_process_group_ranks(host) == [0, 1]
    finally:
        dist.get_backend = backend
    dist.destroy_process_group()


def test_a_wrong_shard_fails_on_every_rank_naming_rank_tensor_and_axis(tmp_path):
    _spawn(tmp_path, 2, [("causal_softmax_attention", [6, 6])], target=_bad_shard_worker)


def test_a_dense_result_is_its_leads_output_zeros_elsewhere_and_the_other_calls_added_in_fp32():
    """ring.py's `_Dense` (the halo exchange's results): per piece, the lead call's output as it is, zeros where
    no lead wrote (a mask that hides a piece's first rows from its own keys), other calls' parts added in fp32 and
    rounded once; every element written (the buffer starts as NaN)."""
    from ncd.families.attention.ring import _Dense, _leads

    calls = ((slice(2, 7), slice(0, 7), None), (slice(0, 3), slice(0, 2), None), (slice(7, 14), slice(7, 14), None))
    pieces = [slice(0, 7), slice(7, 14)]
    assert _leads(calls, pieces, 0) == [0, 2] and _leads(calls, pieces, 1) == [0, 2]
    out = torch.full((1, 2, 14, 3), float("nan"), dtype=torch.bfloat16)
    dense = _Dense(out, pieces, _leads(calls, pieces, 0))
    gen = torch.Generator().manual_seed(1)
    parts = [torch.randn(1, 2, c[0].stop - c[0].start, 3, generator=gen).bfloat16() for c in calls]
    extra = torch.randn(1, 2, 2, 3, generator=gen)  # a halo's rows 3..4, fp32
    for i, (c, part) in enumerate(zip(calls, parts, strict=True)):
        dense.put(i, c[0], part)
    dense.extras[0].append((slice(3, 5), extra))
    want = torch.zeros(1, 2, 14, 3)
    want[:, :, 2:7] += parts[0].float()
    want[:, :, 0:3] += parts[1].float()
    want[:, :, 3:5] += extra
    want[:, :, 7:14] = parts[2].float()
    got = dense.finish()
    assert got is out and not got.isnan().any()
    assert torch.equal(got, want.bfloat16())
