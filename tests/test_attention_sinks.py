"""Issue 32 item 4: attention sinks and softmax-plus-one, on the CPU interpreter.

A sink is one more entry of the key axis with a logit and no value (normalize's `sink = LOGIT`; b(z) = c z + beta
is a constant one). The references here are written from that definition: the softmax of the scores with the
sink's logit appended as one more column, which is then dropped (gpt-oss), or the formula with b itself; forward
and every gradient (Q, K, V and the sink's logits), outputs NaN-poisoned (conftest), odd sizes, fp32."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import ncd
from ncd.errors import NcdError
from ncd.validate import TOLERANCE

from .conftest import ROOT, raise_float_errors

TOL = TOLERANCE[torch.float32]
B, H, NQ, NK, D = 2, 3, 37, 29, 40

HEADER = """
axis batch, head, query, key
axis dim = 40
in  Q[batch head query dim] : f32
in  K[batch head key dim]   : f32
in  V[batch head key dim]   : f32
"""


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-300)).item()


def _compile(tmp_path, name: str, body: str) -> ncd.ops.Op:
    path = tmp_path / f"{name}.ncd"
    path.write_text(f"spec {name}\n{HEADER}{body}")
    return ncd.load(path, cache_dir=tmp_path / "cache")


def _inputs(n_q: int = NQ, n_k: int = NK, big: float = 1.0, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"Q": torch.randn(B, H, n_q, D, generator=g) * big, "K": torch.randn(B, H, n_k, D, generator=g),
            "V": torch.randn(B, H, n_k, D, generator=g)}


def _check(op, inputs: dict, reference, grads: tuple[str, ...]) -> None:
    """The op's output and the gradients `grads` against `reference(**float64 leaves)`."""
    leaves = {k: v.clone().requires_grad_(k in grads) for k, v in inputs.items()}
    with raise_float_errors():
        out = op(**leaves)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    out.backward(g)
    exact = {k: v.detach().double().requires_grad_(k in grads) for k, v in inputs.items()}
    want = reference(**exact)
    want.backward(g.double())
    assert _rel(out.detach(), want.detach()) < TOL, "forward"
    for name in grads:
        assert _rel(leaves[name].grad, exact[name].grad) < TOL, f"d{name}"


def _softmax_with_sink(s: torch.Tensor, sink: torch.Tensor | float, visible: torch.Tensor | None = None):
    """softmax over the keys with the sink's logit as one more column, dropped after: gpt-oss's definition."""
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    column = (sink if isinstance(sink, torch.Tensor) else torch.tensor(float(sink), dtype=s.dtype))
    column = column.expand(*s.shape[:-1], 1) if column.dim() == 0 else column
    return torch.softmax(torch.cat([s, column], -1), -1)[..., :-1]


def _scores(Q, K):
    return Q @ K.transpose(-1, -2) / math.sqrt(D)


def test_sink_softmax_spec_forward_and_every_gradient():
    """The shipped spec: causal softmax with a learned per-head sink, including the sink's gradient."""
    op = ncd.load(ROOT / "specs" / "sink_softmax.ncd", sizes={"dim": D})
    x = _inputs(NQ, NQ)
    x["sink"] = torch.randn(H) * 2
    causal = torch.ones(NQ, NQ, dtype=torch.bool).tril()

    def reference(Q, K, V, sink):
        return _softmax_with_sink(_scores(Q, K), sink.view(1, H, 1, 1).expand(B, H, NQ, 1), causal) @ V

    _check(op, x, reference, ("Q", "K", "V", "sink"))


def test_the_streamed_forward_starts_from_the_sink_and_decoding_merges_it(monkeypatch):
    """The streamed forward takes the sink as its rows' first state (no merge pass, o written in the inputs'
    dtype); split-K decoding merges it after its combine. Both against gpt-oss's definition, the sink's gradient
    included, with the merge counted."""
    from ncd.families.attention import kernel_sink

    merges = []
    merge = kernel_sink.merge
    monkeypatch.setattr(kernel_sink, "merge", lambda *a, **k: merges.append(1) or merge(*a, **k))
    for mode, n_q, n_k, merged in (("never", NQ, NK, 0), ("always", 3, 70, 1)):
        op = ncd.load(ROOT / "specs" / "sink_softmax.ncd", sizes={"dim": D})
        monkeypatch.setattr(op.module, "CONFIG", dataclasses.replace(op.module.CONFIG, decode=mode))
        x = _inputs(n_q, n_k, seed=3)
        x["sink"] = torch.randn(H) * 2
        causal = torch.ones(n_q, n_k, dtype=torch.bool).tril()  # the spec's key <= query

        def reference(Q, K, V, sink, causal=causal, n_q=n_q):
            return _softmax_with_sink(_scores(Q, K), sink.view(1, H, 1, 1).expand(B, H, n_q, 1), causal) @ V

        merges.clear()
        _check(op, x, reference, ("Q", "K", "V", "sink"))
        assert len(merges) == merged, mode


def test_softmax_plus_one_spec_matches_its_formula_at_large_logits():
    """b(z) = 1 + z with logits near 60 (exp would overflow fp32 at 89 without the running max; exp(-m) at
    m = 60 is 1e-26, the sink's share): the op streams it as a sink of logit 0."""
    op = ncd.load(ROOT / "specs" / "softmax_plus_one.ncd", sizes={"dim": D})
    x = _inputs(big=6.0)

    def reference(Q, K, V):
        s = _scores(Q, K)
        top = s.amax(-1, keepdim=True).clamp_min(0)  # exp(s - top) / (exp(-top) + sum exp(s - top))
        e = (s - top).exp()
        return e / ((-top).exp() + e.sum(-1, keepdim=True)) @ V

    _check(op, x, reference, ("Q", "K", "V"))
    plan = "\n".join(op.compiled.plan.describe())
    assert "sink: one more entry of the sum with no value, at t = 0" in plan


def test_a_sink_on_masked_rows_gives_zero_output_and_keeps_its_gradient_finite(tmp_path):
    """Key padding: queries of a batch with no valid key see only the sink, so their output is 0 (its value) and
    they pass no gradient to Q; the sink's logit of that head still gets the other rows' gradient."""
    op = _compile(tmp_path, "padded_sink", """
in    kv_len[batch] : i32
param sink[batch head] : f32
S[batch head query key] = 1 / sqrt(size(dim)) * (Q . K over dim)
A[batch head query key] = normalize(S, over key, a1(x) = exp(x), a2(x) = exp(x), b(z) = z,
                                    mask = key < kv_len, sink = sink)
out O[batch head query dim] = A . V over key
""")
    x = _inputs()
    x["kv_len"] = torch.tensor([0, 11])
    x["sink"] = torch.randn(B, H)
    visible = torch.arange(NK).view(1, 1, 1, NK) < x["kv_len"].view(B, 1, 1, 1)

    def reference(Q, K, V, kv_len, sink):
        return _softmax_with_sink(_scores(Q, K), sink.view(B, H, 1, 1).expand(B, H, NQ, 1), visible) @ V

    _check(op, x, reference, ("Q", "K", "V", "sink"))
    out = op(**x)
    assert torch.all(out[0] == 0)


def test_a_sink_under_plain_sums_and_under_a_pre_map(tmp_path):
    """Spherical attention (a2 = x^2, b = sqrt: no running max) adds a2(sink) = sink^2 to z; softcapped softmax
    (pre-map h = c tanh(x / c)) places the sink at h(sink), and its gradient passes h'."""
    spherical = _compile(tmp_path, "spherical_sink", """
param sink[head] : f32
S[batch head query key] = Q . K over dim
A[batch head query key] = normalize(S, over key, a1(x) = x, a2(x) = x^2, b(z) = sqrt(z), sink = sink)
out O[batch head query dim] = A . V over key
""")
    x = _inputs()
    x["sink"] = torch.randn(H) * 3

    def spherical_ref(Q, K, V, sink):
        s = Q @ K.transpose(-1, -2)
        z = (s * s).sum(-1, keepdim=True) + (sink * sink).view(1, H, 1, 1)
        return s / z.sqrt() @ V

    _check(spherical, x, spherical_ref, ("Q", "K", "V", "sink"))
    capped = _compile(tmp_path, "softcap_sink", """
param sink[head] : f32
S[batch head query key] = Q . K over dim
A[batch head query key] = normalize(S, over key, a1(x) = exp(5 * tanh(x / 5)), a2(x) = exp(5 * tanh(x / 5)),
                                    b(z) = z, sink = sink)
out O[batch head query dim] = A . V over key
""")
    x["sink"] = torch.randn(H) * 4

    def capped_ref(Q, K, V, sink):
        cap = lambda t: 5 * torch.tanh(t / 5)
        return _softmax_with_sink(cap(Q @ K.transpose(-1, -2)), cap(sink).view(1, H, 1, 1).expand(B, H, NQ, 1)) @ V

    _check(capped, x, capped_ref, ("Q", "K", "V", "sink"))


def test_b_with_a_constant_term_is_a_constant_sink(tmp_path):
    """b(z) = 2 z + 3 = 2 (z + 3/2): a sink at log(3/2), with ALiBi's score modifier on top."""
    op = _compile(tmp_path, "offset_alibi", """
param slope[head] : f32
S[batch head query key] = 1 / sqrt(size(dim)) * (Q . K over dim) + slope * (key - query)
A[batch head query key] = normalize(S, over key, a1(x) = exp(x), a2(x) = exp(x), b(z) = 2 * z + 3,
                                    mask = key <= query)
out O[batch head query dim] = A . V over key
""")
    x = _inputs(NQ, NQ)
    x["slope"] = torch.rand(H) * 0.3
    i, j = torch.arange(NQ).view(-1, 1), torch.arange(NQ).view(1, -1)

    def reference(Q, K, V, slope):
        s = _scores(Q, K) + slope.view(1, H, 1, 1) * (j - i)
        e = s.exp().masked_fill(j > i, 0)
        return e / (2 * e.sum(-1, keepdim=True) + 3) @ V

    _check(op, x, reference, ("Q", "K", "V", "slope"))


@pytest.mark.parametrize(("body", "message"), [
    ("param sink[key] : f32\n", "normalize's sink carries axis 'key'"),
    ("param sink[head] : f32\n", "already adds a constant to the sum"),
    ("param w[head] : f32\nsink[head] = w * 2\n", "a number or an input tensor"),
])
def test_sinks_the_kernels_cannot_take_are_located_errors(tmp_path, body, message):
    b = "2 * z + 1" if "already" in message else "z"
    path = tmp_path / "bad.ncd"
    path.write_text(f"spec bad\n{HEADER}{body}"
                    "S[batch head query key] = Q . K over dim\n"
                    f"A[batch head query key] = normalize(S, over key, a1(x) = exp(x), a2(x) = exp(x), b(z) = {b}, "
                    "sink = sink)\n"
                    "out O[batch head query dim] = A . V over key\n")
    from ncd.compiler import compile_spec

    if "a number or an input" in message:  # the attention family declines it; the generic family compiles it
        from ncd.families.attention.plan import plan_attention
        from ncd.pipeline import front_end

        with pytest.raises(NcdError) as err:
            plan_attention(front_end(path.read_text(), "bad.ncd"), {})
    else:
        with pytest.raises(NcdError) as err:
            compile_spec(path, cache_dir=tmp_path / "cache")
    text = str(err.value)
    assert message in text and "bad.ncd:" in text


@pytest.mark.parametrize("spec", ["causal_softmax_attention", "sink_softmax", "spherical_attention", "padded_softmax"])
def test_the_row_statistic_is_a_second_differentiable_output(spec):
    """`return_lse=True`: (O, lse) with lse = log of each row's sum z (softmax: the log-sum-exp, the sink's term
    included; spherical: log sum s^2); a loss reading both gets every gradient, through lse too. Padded rows that see
    no key have lse = -inf and pass nothing."""
    op = ncd.load(ROOT / "specs" / f"{spec}.ncd", sizes={"dim": D})
    x = _inputs(NQ, NQ)
    extra: dict = {}
    if spec == "sink_softmax":
        x["sink"] = torch.randn(H)
    if spec == "padded_softmax":
        extra = {"kv_len": torch.tensor([0, 9]), "q_len": torch.tensor([NQ, 7])}
    names = [n for n in x]
    leaves = {k: v.clone().requires_grad_() for k, v in x.items()}
    exact = {k: v.double().requires_grad_() for k, v in x.items()}
    o, lse = op(**leaves, **extra, return_lse=True)
    assert lse.shape == (B, H, NQ)

    def reference(Q, K, V, sink=None):
        s = Q @ K.transpose(-1, -2) * (1.0 if spec == "spherical_attention" else D**-0.5)
        if spec == "spherical_attention":
            z = (s * s).sum(-1)
            return s / z.sqrt()[..., None] @ V, z.log()
        if spec == "padded_softmax":
            s = s.masked_fill((torch.arange(NQ).view(1, 1, 1, -1) >= extra["kv_len"].view(B, 1, 1, 1))
                              | (torch.arange(NQ).view(1, 1, -1, 1) >= extra["q_len"].view(B, 1, 1, 1)), -torch.inf)
        else:
            s = s.masked_fill(torch.ones(NQ, NQ, dtype=torch.bool).tril().logical_not(), -torch.inf)
        if sink is not None:
            s = torch.cat([s, sink.view(1, H, 1, 1).expand(B, H, NQ, 1)], -1)
        lse_ref = torch.logsumexp(s, -1)
        p = torch.nan_to_num(torch.softmax(s, -1))[..., :NQ]
        return p @ V, lse_ref

    want_o, want_lse = reference(**exact)
    live = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), live)
    assert _rel(o.detach(), want_o.detach()) < TOL and _rel(lse.detach()[live], want_lse.detach()[live]) < TOL
    g = torch.Generator().manual_seed(11)
    go, gl = torch.randn(o.shape, generator=g), torch.randn(lse.shape, generator=g)
    ((o * go).sum() + (torch.where(live, lse, 0) * gl).sum()).backward()
    ((want_o * go.double()).sum() + (torch.where(live, want_lse, 0) * gl.double()).sum()).backward()
    for name in names:
        assert _rel(leaves[name].grad, exact[name].grad) < TOL, f"d{name}"


CHAIN = """
S[batch head query key] = 1 / sqrt(size(dim)) * (Q . K over dim)
P[batch head query key] = normalize(S, over key, a1(x) = exp(x), a2(x) = exp(x), b(z) = z, mask = key <= query)
A[batch head query key] = normalize(P, over key, a1(p) = p, a2(p) = p, b(z) = z{outer})
out O[batch head query dim] = A . V over key
"""


@pytest.mark.parametrize("outer", ["", ", mask = key >= query - 6"])
def test_two_chained_normalisers_that_reduce_to_one_compile_to_the_kernels(tmp_path, outer):
    """A softmax renormalised to sum 1 (a1 = a2 = x, b = z: homogeneous, so the inner 1 / z cancels) is the softmax
    itself, the two masks joined: the attention kernels run it, forward and every gradient against the formula."""
    op = _compile(tmp_path, "chain" + str(len(outer)), CHAIN.format(outer=outer))
    assert op.compiled.plan.family == "attention"
    x = _inputs(NQ, NQ)
    i, j = torch.arange(NQ).view(-1, 1), torch.arange(NQ).view(1, -1)
    visible = (j <= i) & ((j >= i - 6) if outer else True)

    def reference(Q, K, V):
        return torch.softmax(_scores(Q, K).masked_fill(~visible, -torch.inf), -1) @ V

    _check(op, x, reference, ("Q", "K", "V"))


def test_a_chain_that_does_not_reduce_is_a_located_error(tmp_path):
    """Outer b(z) = sqrt(z) with a1 = a2 = x: degrees 1 and 1/2 do not match, so the inner normaliser stays; the
    attention family says so with the place, and the generic family computes the chain as written."""
    path = tmp_path / "chain_sqrt.ncd"
    chain = CHAIN.format(outer="").replace("b(z) = z)\nout", "b(z) = sqrt(z))\nout")
    path.write_text("spec chain_sqrt\n" + HEADER + chain)
    from ncd.families.attention.plan import plan_attention
    from ncd.pipeline import front_end

    with pytest.raises(NcdError) as err:
        plan_attention(front_end(path.read_text(), "chain_sqrt.ncd"), {})
    assert "chain_sqrt.ncd:11:" in str(err.value) and "does not reduce to one" in str(err.value)
    op = ncd.load(path, cache_dir=tmp_path / "cache")
    assert op.compiled.plan.family == "generic"
