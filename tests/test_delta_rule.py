"""The delta rule and the gated delta rule compiled from specs/delta_rule.ncd and specs/gated_delta_rule.ncd by the
recurrence family (kernel_delta.py), run on the CPU Triton interpreter against the float64 per-token recurrence
(reference.naive_delta_rule): forward, every gradient (q, k, v, g, beta, the initial state), final states, chunk
sizes 16, 32 and 64 (one, two and four 16-row blocks of the UT transform), packed sequences of uneven lengths,
decoding after a chunked prefill, non-finite inputs, fla's positional orders, the layers, the derivation and the
refusals. Odd head sizes (K 24, V 20), T spanning at least three chunks; outputs poisoned with NaN."""

from __future__ import annotations

import copy
import itertools
import pickle

import pytest
import torch
import torch.nn.functional as F

import ncd
from ncd.errors import CallError
from ncd.families.recurrence.reference import naive_delta_rule
from ncd.ops import chunk_delta_rule, chunk_gated_delta_rule, recurrent_delta_rule, recurrent_gated_delta_rule

from .conftest import ROOT
from .test_linear_scan import rms_ratio, with_grads

K, V = 24, 20
GATED = (ROOT / "specs" / "gated_delta_rule.ncd").read_text()


def draw(B=2, T=100, H=2, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen).to(dtype)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).to(dtype)
    v = torch.randn(B, T, H, V, generator=gen).to(dtype)
    g = F.logsigmoid(torch.randn(B, T, H, generator=gen) + 3.0)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    return q, k, v, g, beta


@pytest.mark.parametrize("gated, chunk, T", [(True, 64, 150), (True, 32, 100), (False, 16, 53)])
def test_forward_final_state_and_every_gradient_match_the_float64_recurrence(gated, chunk, T):
    q, k, v, g, beta = draw(T=T, seed=chunk)
    s0 = torch.randn(2, 2, K, V) * 0.3
    # the final state's gradient strided (a slice of a wider one), as a caller's slicing or transposing makes it
    do, dfin = torch.randn(v.shape), torch.randn(2, 2, K, 2 * V)[..., :V]
    if gated:
        inputs = (q, k, v, g, beta, s0)
        got = with_grads(lambda *t: chunk_gated_delta_rule(*t[:5], initial_state=t[5], output_final_state=True,
                                                           chunk_size=chunk), inputs, (do, dfin))
        ref = with_grads(lambda *t: naive_delta_rule(t[0], t[1], t[2], t[4], t[3], initial_state=t[5]),
                         [x.double() for x in inputs], (do.double(), dfin.double()))
    else:
        inputs = (q, k, v, beta, s0)
        got = with_grads(lambda *t: chunk_delta_rule(*t[:4], initial_state=t[4], output_final_state=True,
                                                     chunk_size=chunk), inputs, (do, dfin))
        ref = with_grads(lambda *t: naive_delta_rule(*t[:4], initial_state=t[4]), [x.double() for x in inputs],
                         (do.double(), dfin.double()))
    names = ["o", "S_T", "dq", "dk", "dv", *(["dg"] if gated else []), "dbeta", "dS_0"]
    errors = {n: rms_ratio(a, b) for n, a, b in zip(names, got, ref, strict=True)}
    assert max(errors.values()) < 1e-5, errors


def test_bf16_inputs_are_within_the_issues_target():
    q, k, v, g, beta = draw(T=90, dtype=torch.bfloat16, seed=3)
    do = torch.randn(v.shape)
    got = with_grads(lambda *t: chunk_gated_delta_rule(*t)[:1], (q, k, v, g, beta), (do,))
    ref = with_grads(lambda *t: naive_delta_rule(t[0], t[1], t[2], t[4], t[3])[:1],
                     [x.double() for x in (q, k, v, g, beta)], (do.double(),))
    errors = [rms_ratio(a, b) for a, b in zip(got, ref, strict=True)]
    assert max(errors) < 5e-3, errors


def test_packed_sequences_of_uneven_lengths_each_start_from_their_own_state():
    q, k, v, g, beta = draw(B=1, T=90, seed=4)
    bounds = [0, 5, 70, 90]  # shorter than a chunk; two chunks from an unaligned start; one
    s0 = torch.randn(3, 2, K, V) * 0.3
    o, final = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                      cu_seqlens=torch.tensor(bounds, dtype=torch.int32), chunk_size=32)
    for n, (a, b) in enumerate(itertools.pairwise(bounds)):
        ref, state = naive_delta_rule(q[:, a:b].double(), k[:, a:b].double(), v[:, a:b].double(),
                                      beta[:, a:b].double(), g[:, a:b].double(), initial_state=s0[n:n + 1].double())
        assert rms_ratio(o[:, a:b], ref) < 1e-5 and rms_ratio(final[n:n + 1], state) < 1e-5


@pytest.mark.parametrize("gated", [True, False])
def test_decoding_after_a_chunked_prefill_equals_the_chunked_op(gated):
    q, k, v, g, beta = draw(T=70, seed=5)
    chunk = chunk_gated_delta_rule if gated else chunk_delta_rule
    step = recurrent_gated_delta_rule if gated else recurrent_delta_rule

    def args(part):
        return (q[:, part], k[:, part], v[:, part], *((g[:, part],) if gated else ()), beta[:, part])

    whole, final = chunk(*args(slice(None)), output_final_state=True)
    _, state = chunk(*args(slice(None, 60)), output_final_state=True)
    one, state = step(*args(slice(60, 61)), initial_state=state)
    rest, state = step(*args(slice(61, None)), initial_state=state)
    assert rms_ratio(torch.cat([one, rest], 1), whole[:, 60:]) < 1e-5 and rms_ratio(state, final) < 1e-5


def test_non_finite_inputs_give_non_finite_outputs_exactly_where_the_recurrence_does():
    """A NaN value entry poisons its value column from its token on, a non-finite key, beta or gate every column;
    a NaN query its own row; g = -inf resets the state. Chunks of 64 with the bad entries inside them."""
    q, k, v, g, beta = draw(B=1, T=150, H=3, seed=6)
    v[0, 70, 0, 3] = float("nan")
    beta[0, 20, 0] = float("nan")
    k[0, 100, 1, 2] = float("inf")
    g[0, 40, 1] = float("-inf")
    q[0, 10, 2, 0] = float("nan")
    g[0, 130, 2] = float("nan")
    o, final = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    ref, state = naive_delta_rule(*(t.double() for t in (q, k, v, beta, g)))
    assert torch.equal(~torch.isfinite(o), ~torch.isfinite(ref))
    assert torch.equal(~torch.isfinite(final), ~torch.isfinite(state))
    finite = torch.isfinite(ref)
    assert (o.double() - ref)[finite].abs().max() < 1e-4
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
    do = torch.randn(o.shape)
    grads = torch.autograd.grad(chunk_gated_delta_rule(*leaves)[0], leaves, do)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v, g, beta)]
    ref_o = naive_delta_rule(*(ref_leaves[i] for i in (0, 1, 2, 4, 3)))[0]
    for ours, theirs in zip(grads, torch.autograd.grad(ref_o, ref_leaves, do.double()), strict=True):
        assert (~torch.isfinite(ours) | torch.isfinite(theirs)).all()  # non-finite at least where the recurrence's are


def test_fla_positional_orders_a_tensor_scale_and_the_chunk_sizes():
    q, k, v, g, beta = draw(T=40, seed=7)
    scale = torch.tensor(0.3, requires_grad=True)
    o = chunk_gated_delta_rule(q, k, v, g, beta, scale)[0]
    (dscale,) = torch.autograd.grad(o.sum(), scale)
    ref = naive_delta_rule(*(t.double() for t in (q, k, v, beta, g)), scale=0.3)[0]
    assert rms_ratio(o, ref) < 1e-5 and abs(float(dscale) - float(ref.sum()) / 0.3) < 1e-3 * abs(float(ref.sum()))
    plain = chunk_delta_rule(q, k, v, beta, 0.5)[0]
    assert rms_ratio(plain, naive_delta_rule(*(t.double() for t in (q, k, v, beta)), scale=0.5)[0]) < 1e-5
    with pytest.raises(CallError, match="chunk_size must be 16, 32 or 64"):
        chunk_delta_rule(q, k, v, beta, chunk_size=128)
    with pytest.raises(CallError, match="the spec has no g input"):
        ncd.load(ROOT / "specs" / "delta_rule.ncd", sizes={"kdim": K, "vdim": V}).module._OP.chunk(q, k, v, g, beta)


@pytest.mark.parametrize("cls", ["GatedDeltaNet", "DeltaNet"])
def test_the_layers_train_and_survive_pickle(tmp_path, cls):
    from ncd import layers

    torch.manual_seed(0)
    layer = getattr(layers, cls)(hidden_size=2 * K, num_heads=2, chunk_size=16)
    x = torch.randn(2, 29, 2 * K, requires_grad=True)
    y = layer(x)
    y.square().mean().backward()
    assert y.shape == x.shape and torch.isfinite(x.grad).all() and torch.isfinite(layer.b_proj.weight.grad).all()
    torch.save(layer, tmp_path / "layer.pt")
    for other in (pickle.loads(pickle.dumps(layer)), copy.deepcopy(layer),
                  torch.load(tmp_path / "layer.pt", weights_only=False)):
        assert other is not layer and torch.equal(other(x), layer(x))


def test_the_chunked_form_is_derived_from_the_specs_own_scan(tmp_path):
    """The plan proves in sympy that the spec's update is the delta rule and that the chunked UT form reproduces
    it; an update with different algebra is refused at the scan (and compiled by the generic family instead)."""
    from ncd.families.recurrence.plan import plan_recurrence

    for text in (GATED, (ROOT / "specs" / "delta_rule.ncd").read_text()):
        spec = tmp_path / "ok.ncd"
        spec.write_text(text)
        assert "one step is the" in "\n".join(plan_recurrence(ncd.load_spec(spec), {}).describe())
    body = "exp(g) * (prev - beta * (prev . k over kdim) * k) + beta * v * k"
    assert body in GATED
    for wrong, message in (("exp(g) * (prev - beta * (prev . k over kdim) * k) + v * k", "is not the delta rule"),
                           ("exp(g) * (prev - (prev . k over kdim) * k) + beta * v * k", "is not the delta rule"),
                           ("exp(g) * (prev - beta * (prev . q over kdim) * k) + beta * v * k", "one key vector")):
        spec = tmp_path / "refused.ncd"
        spec.write_text(GATED.replace(body, wrong))
        with pytest.raises(ncd.errors.NcdError) as info:
            plan_recurrence(ncd.load_spec(spec), {})
        assert "refused.ncd:" in str(info.value) and message in str(info.value), str(info.value)


def test_head_first_specs_equal_the_fla_layout_and_keys_apart_from_values_are_refused(tmp_path):
    from ncd.families.recurrence.plan import plan_recurrence

    text = GATED.replace("spec gated_delta_rule", "spec gdr_head_first")
    for name in ("q", "k", "v", "g", "beta", "S", "out o"):
        text = text.replace(f"{name}[batch time head", f"{name}[batch head time")
    spec = tmp_path / "gdr_head_first.ncd"
    spec.write_text(text)
    q, k, v, g, beta = draw(T=70, seed=8)
    s0 = torch.randn(2, 2, K, V) * 0.3
    first = ncd.load(spec, sizes={"kdim": K, "vdim": V}).module
    o, final = first.chunk(*(t.transpose(1, 2).contiguous() for t in (q, k, v, g, beta)), initial_state=s0,
                           output_final_state=True, chunk_size=32)
    ref, ref_final = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                            chunk_size=32)
    assert torch.equal(o.transpose(1, 2), ref) and torch.equal(final, ref_final)
    keys_only = GQA.replace("in  v[batch time kvhead vdim]", "in  v[batch time head vdim]")
    spec = tmp_path / "gdr_keys_only.ncd"
    spec.write_text(keys_only)
    with pytest.raises(ncd.errors.NcdError) as info:
        plan_recurrence(ncd.load_spec(spec), {})
    assert "gdr_keys_only.ncd:14:" in str(info.value) and "as [batch time kvhead dim]" in str(info.value), \
        str(info.value)


GQA = GATED.replace("axis batch, time, head", "axis batch, time, kvhead, qgroup\naxis head = kvhead * qgroup").replace(
    "in  k[batch time head kdim]", "in  k[batch time kvhead kdim]").replace(
    "in  v[batch time head vdim]", "in  v[batch time kvhead vdim]")


def test_gqa_keys_and_values_are_shared_by_their_group_of_query_heads(tmp_path):
    """k, v on kvhead: each query head runs the delta rule on its group's keys and values with its own gate and
    writing strength (a state of its own); output, final state and every gradient equal the op's on repeated keys
    and values, dk and dv summed over each group; decoding too; the plan says so."""
    assert GQA.count("kvhead") == 4
    spec = tmp_path / "gdr_gqa.ncd"
    spec.write_text(GQA)
    op = ncd.load(spec, sizes={"kdim": K, "vdim": V}, cache_dir=tmp_path / "cache")
    assert "GQA: repeated per query head" in "\n".join(op.plan.describe())
    q, _, _, g, beta = draw(B=1, T=40, H=4, seed=11)
    _, k, v, _, _ = draw(B=1, T=40, H=2, seed=12)
    s0 = torch.randn(1, 4, K, V) * 0.3
    do, dfin = torch.randn((*q.shape[:3], V)), torch.randn(s0.shape)

    def repeated(*t):
        return chunk_gated_delta_rule(t[0], t[1].repeat_interleave(2, 2), t[2].repeat_interleave(2, 2), t[3], t[4],
                                      initial_state=t[5], output_final_state=True, chunk_size=32)

    want = with_grads(repeated, (q, k, v, g, beta, s0), (do, dfin))
    got = with_grads(lambda *t: op.module.chunk(*t[:5], initial_state=t[5], output_final_state=True,
                                                chunk_size=32), (q, k, v, g, beta, s0), (do, dfin))
    assert got[3].shape == k.shape and got[4].shape == v.shape
    for a, b in zip(got, want, strict=True):
        assert rms_ratio(a, b) < 1e-6
    with torch.no_grad():
        one, state = op.module.recurrent(*(t[:, :1] for t in (q, k, v, g, beta)), initial_state=s0)
        want_one, want_state = recurrent_gated_delta_rule(q[:, :1], k[:, :1].repeat_interleave(2, 2),
                                                          v[:, :1].repeat_interleave(2, 2), g[:, :1], beta[:, :1],
                                                          initial_state=s0)
    assert rms_ratio(one, want_one) < 1e-6 and rms_ratio(state, want_state) < 1e-6
    with pytest.raises(CallError, match="kvhead"):
        op.module.chunk(q[:, :, :3], k, v, g[:, :, :3], beta[:, :, :3])  # 3 query heads over 2 key/value heads


def test_a_shards_state_map_gives_its_run_from_any_incoming_state(tmp_path):
    """chunk_with_state_map (sequence parallelism's one run per shard): o from zero plus S_in's term, and A S_in + F,
    equal the op run from S_in, forward and every gradient (S_in's too), for GQA heads and a tensor scale."""
    spec = tmp_path / "gdr_gqa.ncd"
    spec.write_text(GQA)
    op = ncd.load(spec, sizes={"kdim": K, "vdim": V}, cache_dir=tmp_path / "cache")
    q, _, _, g, beta = draw(B=1, T=45, H=4, seed=13)
    _, k, v, _, _ = draw(B=1, T=45, H=2, seed=14)
    s_in, scale = torch.randn(1, 4, K, V) * 0.3, torch.tensor([0.7])
    do, dfin = torch.randn((*q.shape[:3], V)), torch.randn(s_in.shape)

    def mapped(*t):
        o, o_map, end, a = op.module._OP.chunk_with_state_map(*t[:5], t[6], chunk_size=16)
        assert o_map.shape == (*q.shape[:3], K) and a.shape == (1, 4, K, K) and end.shape == s_in.shape
        return o + torch.einsum("bthk,bhkv->bthv", o_map, t[5]), a @ t[5] + end

    got = with_grads(mapped, (q, k, v, g, beta, s_in, scale), (do, dfin))
    want = with_grads(lambda *t: op.module.chunk(*t[:5], t[6], initial_state=t[5], output_final_state=True,
                                                 chunk_size=16), (q, k, v, g, beta, s_in, scale), (do, dfin))
    names = ["o", "S_T", "dq", "dk", "dv", "dg", "dbeta", "dS_in", "dscale"]
    errors = {n: rms_ratio(a, b) for n, a, b in zip(names, got, want, strict=True)}
    assert max(errors.values()) < 1e-5, errors


def test_the_forward_scan_narrows_its_value_columns_until_its_programs_fill_the_gpu():
    """The scan's programs are (sequence, head, value block)s: at B 4, H 8 the 64-column blocks made 64 programs
    for an H100's 132 multiprocessors (scan 532 us at T 16k against 392 with 32 columns). Off the GPU the H100's
    count is assumed."""
    from ncd.families.recurrence.config import LinearScanConfig
    from ncd.families.recurrence.kernel_delta import _scan_columns

    config, cpu = LinearScanConfig(), torch.device("cpu")
    assert _scan_columns(config, 128, 4 * 16, cpu) == 64
    assert _scan_columns(config, 128, 4 * 8, cpu) == 32
    assert _scan_columns(config, 128, 1, cpu) == 16
    assert _scan_columns(config, 20, 1, cpu) == 16  # never below 16 columns
