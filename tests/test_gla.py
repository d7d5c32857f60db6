"""Gated linear attention with a gate per key dimension (GLA), compiled from specs/gla.ncd by the recurrence family
(kernel_gla.py on kernel_linear.py's kernels), run on the CPU Triton interpreter against the float64 per-token
recurrence (reference.naive_simple_gla with g [B, T, H, K]): forward, every gradient (q, k, v, g, the initial
state), final states, packed sequences of uneven lengths, decoding after a chunked prefill, non-finite inputs,
GQA, the layer, and the recogniser's located refusals. Odd head sizes (K 20, V 12); chunks of 64 and 32 so that
sub-chunks meet both below and on the diagonal, the last chunk partial; outputs poisoned with NaN."""

from __future__ import annotations

import copy
import itertools
import pickle

import pytest
import torch
import torch.nn.functional as F

import ncd
from ncd.errors import CallError
from ncd.families.recurrence.reference import naive_simple_gla
from ncd.ops import chunk_gla, recurrent_gla, shipped_spec

from .conftest import ROOT
from .test_linear_scan import assert_gqa_equals_repeated, gqa_spec, refusal, rms_ratio, with_grads

K, V = 20, 12
BASE = (ROOT / "specs" / "gla.ncd").read_text()
TOL = {torch.float32: 1e-5, torch.bfloat16: 5e-3}  # the bf16 target; fp32 measured at ~4e-7


@pytest.fixture(scope="module")
def gla_op():
    return ncd.load(shipped_spec("gla"), sizes={"kdim": K, "vdim": V})


def draw(B=2, T=83, H=2, dtype=torch.float32, seed=0, kv_heads=None):
    gen = torch.Generator().manual_seed(seed)
    kv = kv_heads or H
    q = torch.randn(B, T, H, K, generator=gen).to(dtype)
    k = (torch.randn(B, T, kv, K, generator=gen) * K ** -0.5).to(dtype)
    v = torch.randn(B, T, kv, V, generator=gen).to(dtype)
    # fla's layer draws logsigmoid(.) / 16; these decay faster, so that sub-chunk reference points matter
    g = F.logsigmoid(torch.randn(B, T, H, K, generator=gen) * 2 + 1.0)
    g[:, 5::37, :, ::3] = -40.0  # steep: these tokens' sub-chunks take the diagonal's per-row path (SPAN)
    return q, k, v, g


@pytest.mark.parametrize("dtype, chunk", [(torch.float32, 64), (torch.bfloat16, 32)])
def test_forward_final_state_and_every_gradient_match_the_float64_recurrence(gla_op, dtype, chunk):
    q, k, v, g = draw(dtype=dtype, seed=1)
    s0 = torch.randn(2, 2, K, V) * 0.1
    do, dfin = torch.randn(v.shape), torch.randn(s0.shape)
    ref = with_grads(lambda *t: naive_simple_gla(*t[:4], initial_state=t[4]),
                     [x.double() for x in (q, k, v, g, s0)], (do.double(), dfin.double()))
    got = with_grads(lambda *t: gla_op.module.chunk(*t[:4], initial_state=t[4], output_final_state=True,
                                                    chunk_size=chunk), (q, k, v, g, s0), (do, dfin))
    names = ["o", "S_T", "dq", "dk", "dv", "dg", "dS_0"]
    errors = {n: rms_ratio(a, b) for n, a, b in zip(names, got, ref, strict=True)}
    assert got[5].shape == g.shape and max(errors.values()) < TOL[dtype], errors


def test_packed_sequences_of_uneven_lengths_and_decoding_after_a_prefill(gla_op):
    bounds = (0, 5, 45, 83)  # shorter than a sub-chunk; two chunks from an unaligned start; 38 tokens
    q, k, v, g = draw(B=1, T=bounds[-1], H=2, seed=3)
    s0 = torch.randn(3, 2, K, V) * 0.1
    do, dfin = torch.randn(v.shape), torch.randn(s0.shape)
    cu = torch.tensor(bounds, dtype=torch.int32)
    got = with_grads(lambda *t: chunk_gla(*t[:4], None, t[4], True, cu, chunk_size=32), (q, k, v, g, s0),
                     (do, dfin))

    def separate(q, k, v, g, s0):
        pieces = [naive_simple_gla(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], initial_state=s0[n:n + 1])
                  for n, (a, b) in enumerate(itertools.pairwise(bounds))]
        return torch.cat([p[0] for p in pieces], 1), torch.cat([p[1] for p in pieces], 0)

    ref = with_grads(separate, [x.double() for x in (q, k, v, g, s0)], (do.double(), dfin.double()))
    for a, b in zip(got, ref, strict=True):
        assert rms_ratio(a, b) < 1e-5
    with torch.no_grad():  # decoding continues a chunked prefill of the last sequence
        whole, final = naive_simple_gla(*(t[:, 45:].double() for t in (q, k, v, g)))
        _, state = gla_op.module.chunk(*(t[:, 45:70] for t in (q, k, v, g)), output_final_state=True)
        one, state = gla_op.module.recurrent(*(t[:, 70:71] for t in (q, k, v, g)), initial_state=state)
        rest, state = recurrent_gla(*(t[:, 71:] for t in (q, k, v, g)), initial_state=state)
    assert rms_ratio(torch.cat([one, rest], 1), whole[:, 25:]) < 1e-5 and rms_ratio(state, final) < 1e-5


def test_non_finite_inputs_are_non_finite_exactly_where_the_recurrence_is(gla_op):
    """A NaN value at (t, j) makes column j NaN from t on; a NaN key or gate entry (t, d) its key row d, so every
    later output of its head; a NaN query its own row; g = -inf resets its key row, not a NaN. Placed inside and
    across sub-chunks of a chunk of 64; the gradients are non-finite at least where the recurrence's are."""
    q, k, v, g = draw(B=2, T=83, H=2, seed=5)
    v[0, 37, 0, 3] = float("nan")
    k[0, 20, 1, 5] = float("nan")
    g[1, 40, 0, 2] = float("nan")
    q[1, 9, 1, 0] = float("nan")
    g[1, 30, 1, :] = float("-inf")
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g)]
    o, final = gla_op.module.chunk(*leaves, output_final_state=True, chunk_size=64)
    ref, ref_final = naive_simple_gla(*[t.double() for t in (q, k, v, g)])
    assert torch.equal(torch.isfinite(o), torch.isfinite(ref))
    assert torch.equal(torch.isfinite(final), torch.isfinite(ref_final))
    assert torch.isfinite(o[0, 40:, 0, :3]).all() and torch.isfinite(o[1, 31:, 1]).all()  # a column; a reset
    finite = torch.isfinite(ref)
    assert torch.allclose(o.detach()[finite].double(), ref[finite], atol=1e-4)
    do = torch.randn(o.shape)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v, g)]
    ref_grads = torch.autograd.grad(naive_simple_gla(*ref_leaves)[0], ref_leaves, do.double())
    for ours, theirs in zip(torch.autograd.grad(o, leaves, do), ref_grads, strict=True):
        assert (~torch.isfinite(ours) | torch.isfinite(theirs)).all()


GQA = gqa_spec(BASE)


def test_gqa_keys_and_values_are_shared_by_their_group_of_query_heads(gla_op, tmp_path):
    """k, v on kvhead: query head h reads key/value head h // qgroup, each with gates of its own; output, final
    state and gradients equal the op's on repeated keys and values, dk and dv summed over each group."""
    spec = tmp_path / "gla_gqa.ncd"
    spec.write_text(GQA)
    op = ncd.load(spec, sizes={"kdim": K, "vdim": V}, cache_dir=tmp_path / "cache")
    q, k, v, g = draw(B=1, T=40, H=4, seed=8, kv_heads=2)
    s0 = torch.randn(1, 4, K, V) * 0.1
    assert_gqa_equals_repeated(op, gla_op, (q, k, v, g, s0), (torch.randn((*q.shape[:3], V)), torch.randn(s0.shape)),
                               group=2, chunk=32)


def test_the_layer_trains_uses_the_compiled_core_and_survives_pickle(tmp_path, monkeypatch):
    from ncd import layers

    torch.manual_seed(0)
    layer = layers.GatedLinearAttention(hidden_size=2 * K, num_heads=2, chunk_size=16, clamp_min=-3.0)
    x = torch.randn(2, 29, 2 * K, requires_grad=True)
    y = layer(x)
    y.square().mean().backward()
    assert y.shape == x.shape and torch.isfinite(x.grad).all()
    assert torch.isfinite(layer.gk_proj[0].weight.grad).all() and layer.gk_proj[1].weight.shape == (2 * K, 16)
    gates = []

    def naive_core(q, k, v, g, scale, initial_state, output_final_state, cu_seqlens, chunk_size):
        gates.append(g)
        return naive_simple_gla(q.double(), k.double(), v.double(), g.double(), scale)[0].float(), None

    monkeypatch.setattr(layers.GatedLinearAttention, "_core", staticmethod(naive_core))
    assert rms_ratio(y, layer(x)) < 1e-5
    assert gates[0].shape == (2, 29, 2, K) and gates[0].min() >= -3.0 and gates[0].max() <= 0
    monkeypatch.undo()
    torch.save(layer, tmp_path / "layer.pt")
    for other in (pickle.loads(pickle.dumps(layer)), copy.deepcopy(layer),
                  torch.load(tmp_path / "layer.pt", weights_only=False)):
        assert other is not layer and torch.equal(other(x), layer(x))


@pytest.mark.parametrize("old, new, message", [
    ("in  g[batch time head kdim] : f32", "in  g[batch time head vdim] : f32",
     "[batch time head kdim] (a gate per key"),
    ("in  g[batch time head kdim] : f32", "in  g[batch time head kdim vdim] : f32", "or [head] (one per head"),
])
def test_the_recogniser_refuses_a_gate_on_another_axis_at_its_location(tmp_path, old, new, message):
    assert old in BASE
    text = refusal(tmp_path, BASE.replace(old, new), "gla_refused")
    assert "gla_refused.ncd:" in text and message in text, text


def test_call_errors_name_the_gate_and_its_axis(gla_op):
    q, k, v, g = draw(B=1, T=20, seed=9)
    with pytest.raises(CallError, match="g: axis 'kdim'"):
        gla_op.module.chunk(q, k, v, g[..., :-1])
    with pytest.raises(CallError, match="g"):
        gla_op.module.chunk(q, k, v, g[..., 0])


def test_the_backward_recomputes_the_scores_the_eager_forward_keeps(gla_op):
    """Eager calls keep the chunks' scores for the backward; the custom op's backward (torch.compile) recomputes
    them: the gradients are the same either way."""
    q, k, v, g = draw(B=1, T=45, seed=10)
    scale, module = K ** -0.5, gla_op.module
    (o, _), scores = module.eager_forward((True,) * 9, q, k, v, g, None, None, scale, 32, False)
    do = torch.randn(o.shape)
    kept = module.backward(do, None, q, k, v, g, None, None, scale, 32, scores)
    recomputed = module.backward(do, None, q, k, v, g, None, None, scale, 32)
    assert scores.shape == (1, 45, 2, 32) and torch.equal(o, module.forward(q, k, v, g, None, None, scale, 32,
                                                                             False)[0])
    for a, b in zip(kept[:4], recomputed[:4], strict=True):
        assert torch.equal(a, b)


def test_head_first_gates_per_key_run_as_sequences_of_one_head(gla_op, tmp_path):
    """[batch head time dim] inputs, g [batch head time kdim]: the same kernels on B x H sequences of one head; the
    output, final state and every gradient equal the time-first op's."""
    spec = tmp_path / "gla_head_first.ncd"
    spec.write_text(BASE.replace("[batch time head", "[batch head time"))
    op = ncd.load(spec, sizes={"kdim": K, "vdim": V}, cache_dir=tmp_path / "cache")
    q, k, v, g = draw(B=1, T=40, seed=13)
    s0 = torch.randn(1, 2, K, V) * 0.1
    do, dfin = torch.randn(v.shape), torch.randn(s0.shape)

    def head_first(t):
        return t.transpose(1, 2).contiguous()

    want = with_grads(lambda *t: gla_op.module.chunk(*t[:4], initial_state=t[4], output_final_state=True,
                                                     chunk_size=32), (q, k, v, g, s0), (do, dfin))
    got = with_grads(lambda *t: op.module.chunk(*t[:4], initial_state=t[4], output_final_state=True, chunk_size=32),
                     (*map(head_first, (q, k, v, g)), s0), (head_first(do), dfin))
    for index, (a, b) in enumerate(zip(got, want, strict=True)):
        assert rms_ratio(a.transpose(1, 2) if index in (0, 2, 3, 4, 5) else a, b) < 1e-6, index
