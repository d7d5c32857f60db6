"""Gated linear attention compiled from specs/simple_gla.ncd by the recurrence family (kernel_linear.py), run on the
CPU Triton interpreter against the float64 per-token recurrence (reference.naive_simple_gla): forward, every
gradient (q, k, v, g, the initial state), final states, packed sequences of uneven lengths, decoding after a
chunked prefill, non-finite inputs, fla's positional order, the layer, and the recogniser's located refusals.
Odd head sizes (K 24, V 20), T spanning 7 chunks of 16; outputs poisoned with NaN (NCD_POISON_OUTPUTS)."""

from __future__ import annotations

import copy
import itertools
import pickle

import pytest
import torch
import torch.nn.functional as F

import ncd
from ncd.errors import CallError, NcdError
from ncd.families.recurrence.plan import plan_recurrence
from ncd.families.recurrence.reference import naive_simple_gla
from ncd.ops import ConfigError, chunk_simple_gla, recurrent_simple_gla, shipped_spec

from .conftest import ROOT

K, V = 24, 20
BASE = (ROOT / "specs" / "simple_gla.ncd").read_text()
TOL = {torch.float32: 1e-5, torch.bfloat16: 5e-3}  # the bf16 target; fp32 measured at ~1e-7


@pytest.fixture(scope="module")
def gla_op():
    return ncd.load(shipped_spec("simple_gla"), sizes={"kdim": K, "vdim": V})


def draw(B=2, T=100, H=3, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen).to(dtype)
    k = (torch.randn(B, T, H, K, generator=gen) * K ** -0.5).to(dtype)
    v = torch.randn(B, T, H, V, generator=gen).to(dtype)
    g = F.logsigmoid(torch.randn(B, T, H, generator=gen) + 3.0)
    return q, k, v, g


def rms_ratio(value, ref):
    value, ref = value.detach().double(), ref.detach().double()
    assert not torch.isnan(value).any()
    return float((value - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())


def with_grads(fn, inputs, cotangents):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    outs = fn(*leaves)
    return [*outs, *torch.autograd.grad(outs, leaves, [c.to(o.dtype) for c, o in zip(cotangents, outs, strict=True)])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_final_state_and_every_gradient_match_the_float64_recurrence(gla_op, dtype):
    q, k, v, g = draw(dtype=dtype, seed=1)
    s0 = torch.randn(2, 3, K, V) * 0.1
    # the final state's gradient strided (a slice of a wider one), as a caller's slicing or transposing makes it
    do, dfin = torch.randn(v.shape), torch.randn(2, 3, K, 2 * V)[..., :V]
    ref = with_grads(lambda *t: naive_simple_gla(*t[:4], initial_state=t[4]),
                     [x.double() for x in (q, k, v, g, s0)], (do.double(), dfin.double()))
    got = with_grads(lambda *t: gla_op.module.chunk(*t[:4], initial_state=t[4], output_final_state=True,
                                                    chunk_size=16), (q, k, v, g, s0), (do, dfin))
    names = ["o", "S_T", "dq", "dk", "dv", "dg", "dS_0"]
    errors = {n: rms_ratio(a, b) for n, a, b in zip(names, got, ref, strict=True)}
    assert max(errors.values()) < TOL[dtype], errors


def test_the_16_bit_backward_is_within_bf16_rounding_and_the_config_is_checked(gla_op):
    fast = gla_op.with_config(grad_precision="input").module
    q, k, v, g = draw(dtype=torch.bfloat16, seed=2)
    do = torch.randn(v.shape)
    ref = with_grads(lambda *t: naive_simple_gla(*t)[:1], [x.double() for x in (q, k, v, g)], (do.double(),))
    got = with_grads(lambda *t: fast.chunk(*t, chunk_size=16)[:1], (q, k, v, g), (do,))
    assert max(rms_ratio(a, b) for a, b in zip(got, ref, strict=True)) < 2e-2
    with pytest.raises(ConfigError, match="grad_precision must be tf32 or input"):
        gla_op.with_config(grad_precision="bf16")


def test_packed_sequences_of_uneven_lengths_match_separate_recurrences(gla_op):
    bounds = (0, 5, 45, 83)  # shorter than a chunk; three chunks from an unaligned start; 38 tokens
    q, k, v, g = draw(B=1, T=bounds[-1], H=2, seed=3)
    s0 = torch.randn(3, 2, K, V) * 0.1
    do, dfin = torch.randn(v.shape), torch.randn(s0.shape)
    cu = torch.tensor(bounds, dtype=torch.int32)
    got = with_grads(lambda *t: gla_op.module.chunk(*t[:4], initial_state=t[4], output_final_state=True,
                                                    cu_seqlens=cu, chunk_size=16), (q, k, v, g, s0), (do, dfin))

    def separate(q, k, v, g, s0):
        pieces = [naive_simple_gla(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], initial_state=s0[n:n + 1])
                  for n, (a, b) in enumerate(itertools.pairwise(bounds))]
        return torch.cat([p[0] for p in pieces], 1), torch.cat([p[1] for p in pieces], 0)

    ref = with_grads(separate, [x.double() for x in (q, k, v, g, s0)], (do.double(), dfin.double()))
    for a, b in zip(got, ref, strict=True):
        assert rms_ratio(a, b) < 1e-5


def test_decoding_continues_a_chunked_prefill_token_by_token(gla_op):
    q, k, v, g = draw(B=2, T=45, H=2, seed=4)
    with torch.no_grad():
        whole, final = gla_op.module.chunk(q, k, v, g, output_final_state=True, chunk_size=16)
        _, state = gla_op.module.chunk(q[:, :37], k[:, :37], v[:, :37], g[:, :37], output_final_state=True)
        one, state = gla_op.module.recurrent(q[:, 37:38], k[:, 37:38], v[:, 37:38], g[:, 37:38], initial_state=state)
        rest, state = recurrent_simple_gla(q[:, 38:], k[:, 38:], v[:, 38:], g[:, 38:], initial_state=state)
    assert rms_ratio(torch.cat([one, rest], 1), whole[:, 37:]) < 1e-5 and rms_ratio(state, final) < 1e-5
    with pytest.raises(CallError, match="recurrent\\(\\) is for decoding"):
        gla_op.module.recurrent(q.requires_grad_(), k, v, g)


def test_non_finite_inputs_are_non_finite_exactly_where_the_recurrence_is(gla_op):
    """A NaN value at (t, j) makes column j NaN from t on; an infinite key, a NaN or +inf gate its sequence and
    head from t on; a NaN query its own row; g = -inf is a full reset, not a NaN. The forward's non-finite entries
    are exactly the float64 recurrence's, in chunks that also hold finite rows before them; the gradients are
    non-finite at least where the recurrence's are."""
    q, k, v, g = draw(B=2, T=70, H=4, seed=5)
    v[0, 37, 0, 3] = float("nan")
    k[0, 20, 1, 5] = float("inf")
    g[1, 40, 2] = float("nan")
    g[1, 50, 0] = float("inf")
    q[1, 9, 3, 0] = float("nan")
    g[0, 30, 3] = float("-inf")
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g)]
    o, final = gla_op.module.chunk(*leaves, output_final_state=True, chunk_size=16)
    ref, ref_final = naive_simple_gla(*[t.double() for t in (q, k, v, g)])
    assert torch.equal(torch.isfinite(o), torch.isfinite(ref))
    assert torch.equal(torch.isfinite(final), torch.isfinite(ref_final))
    assert torch.isfinite(o[0, 40:, 0, :3]).all() and torch.isfinite(o[0, :, 3]).all()  # a column; a reset
    finite = torch.isfinite(ref)
    assert torch.allclose(o.detach()[finite].double(), ref[finite], atol=1e-4)
    do = torch.randn(o.shape)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v, g)]
    ref_grads = torch.autograd.grad(naive_simple_gla(*ref_leaves)[0], ref_leaves, do.double())
    for ours, theirs in zip(torch.autograd.grad(o, leaves, do), ref_grads, strict=True):
        assert (~torch.isfinite(ours) | torch.isfinite(theirs)).all()


def test_fla_positional_order_a_tensor_scale_and_the_ops_entry(gla_op):
    q, k, v, g = draw(B=1, T=40, H=2, seed=6)
    s0 = torch.randn(1, 2, K, V)
    o, final = chunk_simple_gla(q, k, v, g, 0.5, s0, True, None)  # fla's chunk_gla order
    ref, ref_final = naive_simple_gla(*[t.double() for t in (q, k, v, g)], scale=0.5, initial_state=s0.double())
    assert rms_ratio(o, ref) < 1e-5 and rms_ratio(final, ref_final) < 1e-5
    scale = torch.tensor(0.3, requires_grad=True)
    o = gla_op.module.chunk(q, k, v, g, scale)[0]
    (o * o).sum().backward()  # o is linear in the scale: d/ds sum(o^2) = 2 sum(o^2) / s
    assert torch.allclose(scale.grad, (2 * o * o / 0.3).sum().detach(), rtol=1e-4)
    with pytest.raises(CallError, match=r"initial_state must have shape \(1, 2, 24, 20\)"):
        gla_op.module.chunk(q, k, v, g, initial_state=torch.zeros(1, 2, V, K))
    with pytest.raises(CallError, match="v: axis 'time' has size 39"):
        gla_op.module.chunk(q, k, v[:, :39], g)


def test_the_layer_trains_uses_the_compiled_core_and_survives_pickle(tmp_path, monkeypatch):
    from ncd import layers

    torch.manual_seed(0)
    layer = layers.SimpleGatedLinearAttention(hidden_size=2 * K, num_heads=2, use_short_conv=True, chunk_size=16)
    x = torch.randn(2, 29, 2 * K, requires_grad=True)
    y = layer(x)
    y.square().mean().backward()
    assert y.shape == x.shape and torch.isfinite(x.grad).all() and torch.isfinite(layer.gk_proj.weight.grad).all()

    def naive_core(q, k, v, g, scale, initial_state, output_final_state, cu_seqlens, chunk_size):
        return naive_simple_gla(q.double(), k.double(), v.double(), g.double(), scale)[0].float(), None

    monkeypatch.setattr(layers, "chunk_simple_gla", naive_core)
    assert rms_ratio(y, layer(x)) < 1e-5
    monkeypatch.undo()
    torch.save(layer, tmp_path / "layer.pt")
    for other in (pickle.loads(pickle.dumps(layer)), copy.deepcopy(layer),
                  torch.load(tmp_path / "layer.pt", weights_only=False)):
        assert other is not layer and torch.equal(other(x), layer(x))


def refusal(tmp_path, text, name):
    spec = tmp_path / f"{name}.ncd"
    spec.write_text(text)
    front = ncd.load_spec(spec)
    with pytest.raises(NcdError) as info:
        plan_recurrence(front, {})
    return str(info.value)


@pytest.mark.parametrize("old, new, message", [
    ("in  g[batch time head] : f32", "in  g[batch time head vdim] : f32", "declare g as [batch time head] (a gate"),
    ("[batch time head", "[time batch head", "the scanned axis 'time' second or third"),
    ("in  scale : f32 = 1 / sqrt(size(kdim))", "in  scale : f32 = 1 / sqrt(size(kdim))\nin  extra[head] : f32",
     "extra has no role"),
    ("exp(g) * prev", "sigmoid(g) * prev", "expected a gate exp(g)"),
    ("v * k, over", "v * q, over", "q serves as both"),
])
def test_the_recogniser_refuses_what_it_cannot_compile_at_its_location(tmp_path, old, new, message):
    assert old in BASE
    text = refusal(tmp_path, BASE.replace(old, new), "gla_refused")
    assert "gla_refused.ncd:" in text and message in text, text


def test_the_chunked_form_is_derived_from_the_specs_own_scan(tmp_path):
    """The plan's derivation unrolls the spec's scan body in sympy: it holds for the shipped spec and fails for a
    recurrence whose algebra differs (a doubled update, a gate on the update), which the chunked kernels would
    compute wrongly."""
    from ncd import ir
    from ncd.families.recurrence.linear import derive_chunked_form

    def scan_of(text):
        spec = tmp_path / "derived.ncd"
        spec.write_text(text)
        return next(d.value for d in ncd.load_spec(spec).program.definitions if isinstance(d.value, ir.Scan))

    assert "equal the chunked form" in derive_chunked_form(scan_of(BASE), "g", "k", "v", "q")
    for body in ("exp(g) * prev + 2 * v * k", "exp(g) * (prev + v * k)"):
        with pytest.raises(ValueError, match="differs from the chunked form"):
            derive_chunked_form(scan_of(BASE.replace("exp(g) * prev + v * k", body)), "g", "k", "v", "q")


def test_head_first_inputs_run_as_sequences_of_one_head(gla_op, tmp_path, run_cli):
    """A spec declaring [batch head time dim] compiles to the same kernels (B x H sequences of one head, views of
    the inputs): output, final state and gradients equal the time-first op's on the same data; decoding too;
    packing along time is refused; `ncd check` validates the spec."""
    spec = tmp_path / "gla_head_first.ncd"
    spec.write_text(BASE.replace("[batch time head", "[batch head time"))
    op = ncd.load(spec, sizes={"kdim": K, "vdim": V}, cache_dir=tmp_path / "cache")
    q, k, v, g = draw(B=2, T=40, H=3, seed=7)
    s0 = torch.randn(2, 3, K, V) * 0.1
    do, dfin = torch.randn(v.shape), torch.randn(s0.shape)

    def head_first(t):
        return t.transpose(1, 2).contiguous()

    want = with_grads(lambda *t: gla_op.module.chunk(*t[:4], initial_state=t[4], output_final_state=True,
                                                     chunk_size=16), (q, k, v, g, s0), (do, dfin))
    got = with_grads(lambda *t: op.module.chunk(*t[:4], initial_state=t[4], output_final_state=True, chunk_size=16),
                     (*map(head_first, (q, k, v, g)), s0), (head_first(do), dfin))
    for index, (a, b) in enumerate(zip(got, want, strict=True)):
        assert rms_ratio(a.transpose(1, 2) if index in (0, 2, 3, 4, 5) else a, b) < 1e-6, index
    with torch.no_grad():
        one, state = op.module.recurrent(*(head_first(t[:, :1]) for t in (q, k, v, g)), initial_state=s0)
        want_one, want_state = gla_op.module.recurrent(q[:, :1], k[:, :1], v[:, :1], g[:, :1], initial_state=s0)
    assert rms_ratio(one.transpose(1, 2), want_one) < 1e-6 and rms_ratio(state, want_state) < 1e-6
    with pytest.raises(CallError, match="declares its inputs head-first"):
        op.module.chunk(*map(head_first, (q[:1], k[:1], v[:1], g[:1])), cu_seqlens=torch.tensor([0, 3, 40]))
    code, out, err = run_cli("check", str(spec))
    assert code == 0 and "ok   numerics" in out, out + err


def gqa_spec(base: str) -> str:
    """`base` with `axis head = kvhead * qgroup` and k, v on kvhead."""
    text = base.replace("axis batch, time, head", "axis batch, time, kvhead, qgroup\naxis head = kvhead * qgroup")
    text = text.replace("in  k[batch time head kdim]", "in  k[batch time kvhead kdim]")
    text = text.replace("in  v[batch time head vdim]", "in  v[batch time kvhead vdim]")
    assert text.count("kvhead") == 4
    return text


def assert_gqa_equals_repeated(op, plain_op, inputs, cotangents, group, chunk):
    """op (keys and values on kvhead) against plain_op on keys and values repeated per query head: output, final
    state and every gradient (dk, dv the group sums), inputs (q, k, v, g, s0)."""
    def repeated(*t):
        return plain_op.module.chunk(t[0], t[1].repeat_interleave(group, 2), t[2].repeat_interleave(group, 2), t[3],
                                     initial_state=t[4], output_final_state=True, chunk_size=chunk)

    want = with_grads(repeated, inputs, cotangents)
    got = with_grads(lambda *t: op.module.chunk(*t[:4], initial_state=t[4], output_final_state=True,
                                                chunk_size=chunk), inputs, cotangents)
    assert got[3].shape == inputs[1].shape and got[4].shape == inputs[2].shape
    for a, b in zip(got, want, strict=True):
        assert rms_ratio(a, b) < 1e-6


GQA = gqa_spec(BASE)


def test_gqa_keys_and_values_are_shared_by_their_group_of_query_heads(gla_op, tmp_path, run_cli):
    """`axis head = kvhead * qgroup` with k, v on kvhead: query head h reads key/value head h // qgroup, with no
    copies; the output and final state equal the op's on repeated keys and values, and dk, dv are the group sums
    of its gradients; decoding too; `ncd check` validates the spec."""
    spec = tmp_path / "gla_gqa.ncd"
    spec.write_text(GQA)
    op = ncd.load(spec, sizes={"kdim": K, "vdim": V}, cache_dir=tmp_path / "cache")
    q, _, _, g = draw(B=2, T=40, H=6, seed=8)
    _, k, v, _ = draw(B=2, T=40, H=2, seed=9)  # 2 key/value heads, 3 query heads each
    s0 = torch.randn(2, 6, K, V) * 0.1
    assert_gqa_equals_repeated(op, gla_op, (q, k, v, g, s0), (torch.randn((*q.shape[:3], V)), torch.randn(s0.shape)),
                               group=3, chunk=16)
    with torch.no_grad():
        one, state = op.module.recurrent(q[:, :1], k[:, :1], v[:, :1], g[:, :1], initial_state=s0)
        want_one, want_state = gla_op.module.recurrent(q[:, :1], k[:, :1].repeat_interleave(3, 2),
                                                       v[:, :1].repeat_interleave(3, 2), g[:, :1], initial_state=s0)
    assert rms_ratio(one, want_one) < 1e-6 and rms_ratio(state, want_state) < 1e-6
    with pytest.raises(CallError, match="kvhead"):
        op.module.chunk(q[:, :, :5], k, v, g[:, :, :5])  # 5 query heads over 2 key/value heads
    code, out, err = run_cli("check", str(spec))
    assert code == 0 and "ok   numerics" in out, out + err
    head_first = GQA.replace("[batch time head", "[batch head time").replace("[batch time kvhead", "[batch kvhead time")
    text = refusal(tmp_path, head_first, "gla_gqa_head_first")
    assert "gla_gqa_head_first.ncd:" in text and "in fla's layout only" in text, text


def test_a_gate_per_head_is_retnets_decay_broadcast_over_batch_and_time(gla_op):
    """specs/retnet.ncd declares g[head]: the op broadcasts it to every token (a view), so the output equals the
    per-token op's with the gate repeated, and dg is the sum of its per-token gradients."""
    op = ncd.load(shipped_spec("retnet"), sizes={"kdim": K, "vdim": V})
    q, k, v, _ = draw(B=2, T=40, H=3, seed=10)
    gamma = torch.log(1 - 2.0 ** (-5.0 - torch.arange(3.0)))  # RetNet's decays
    do = torch.randn(v.shape)
    got = with_grads(lambda *t: op.module.chunk(*t, chunk_size=16)[:1], (q, k, v, gamma), (do,))
    want = with_grads(lambda *t: gla_op.module.chunk(*t[:3], t[3].expand(2, 40, 3), chunk_size=16)[:1],
                      (q, k, v, gamma), (do,))
    assert got[-1].shape == (3,)
    for a, b in zip(got, want, strict=True):
        assert rms_ratio(a, b) < 1e-6
    with torch.no_grad():
        one, _ = op.module.recurrent(q[:, :1], k[:, :1], v[:, :1], gamma)
    assert rms_ratio(one, want[0][:, :1]) < 1e-5
