"""Issue 30, attention family: no silent wrong results.

Exponential maps other than exp(c x) are stabilised (a running max of h(x) for exp(h(x))) or rejected; masked rows
(no visible key of nonzero weight) give output 0 and zero gradients in every kernel form; inputs whose gradient the
kernels do not compute, and double backward, fail at the call; scale expressions and size() in maps compile; empty
and meta tensors and a scale of the wrong shape are answered at the call. Interpreter, small odd sizes, outputs
poisoned with NaN, forward and every gradient against float64."""

from __future__ import annotations

import pytest
import torch

import ncd
from ncd.backend import FallbackWarning, plan, select
from ncd.errors import CallError, NcdError
from ncd.families.attention.plan import plan_attention
from ncd.reference import evaluate
from ncd.streaming import X

from .conftest import ROOT, raise_float_errors

HEADER = """spec {name}

axis batch, head, query, key
axis dim

in  Q[batch head query dim] : f32
in  K[batch head key dim]   : f32
in  V[batch head key dim]   : f32
{extra}
S[batch head query key] = {score}
A[batch head query key] = normalize(S, over key, a1(x) = {a1}, a2(x) = {a2}, b(z) = {b}{options})
out O[batch head query dim] = A . V over key
"""


def _spec(tmp_path, name, a1, a2=None, b="z", score="scale * (Q . K over dim)",
          extra="in  scale : f32 = 1 / sqrt(size(dim))\n", options=""):
    path = tmp_path / f"{name}.ncd"
    path.write_text(HEADER.format(name=name, a1=a1, a2=a2 or a1, b=b, score=score, extra=extra, options=options))
    return path


def _load(path, cache):
    return ncd.load(path, cache_dir=cache)  # unwritten outputs surface as NaN: NCD_POISON_OUTPUTS (conftest)


def _rel(value, ref):
    value, ref = value.detach().double(), ref.detach()
    return float((value - ref).norm() / ref.norm().clamp_min(1e-300))


def _run(op, inputs, grad_out, differentiable=("Q", "K", "V")):
    leaves = {n: t.detach().clone().requires_grad_(n in differentiable) for n, t in inputs.items()}
    out = op(*leaves.values())
    grads = torch.autograd.grad(out, [leaves[n] for n in differentiable], grad_out)
    return out, dict(zip(differentiable, grads, strict=True))


def _reference(op, inputs, grad_out, differentiable=("Q", "K", "V")):
    leaves = {n: t.detach().double().requires_grad_(n in differentiable) for n, t in inputs.items()}
    out = evaluate(op.front.program, leaves)["O"]
    grads = torch.autograd.grad(out, [leaves[n] for n in differentiable], grad_out.double())
    return out, dict(zip(differentiable, grads, strict=True))


def _qkv(generator, batch=1, heads=2, n=13, d=8, spread=1.0):
    return {n_: torch.randn(batch, heads, n, d, generator=generator) * (spread if n_ != "V" else 1.0)
            for n_ in "QKV"}


# ---------------------------------------------------------------------------------------------------------------
# 4. exponentials that can overflow: stabilised by a running max of h for exp(h(x)), or rejected
# ---------------------------------------------------------------------------------------------------------------

def _large_scores(generator, d=8):
    """Q, K scaled so that the scores scale * q.k reach about +-1e3 (N 13, D 8)."""
    inputs = _qkv(generator, n=13, d=d, spread=14.0)
    s = (inputs["Q"] @ inputs["K"].transpose(-1, -2)) * d**-0.5
    assert 5e2 < float(s.abs().max()) < 2e3
    return inputs


def test_softcap_streams_with_a_running_max_of_its_pre_map(tmp_path, op_cache):
    cap = "exp(100 * tanh(x / 100))"
    op = _load(_spec(tmp_path, "softcap_trust", cap), op_cache)
    lines = "\n".join(plan(op.front).describe())
    assert "pre-map" in lines and "tanh" in lines and "online max" in lines
    generator = torch.Generator().manual_seed(1)
    inputs = _large_scores(generator)
    grad_out = torch.randn(1, 2, 13, 8, generator=generator)
    with raise_float_errors():
        out, grads = _run(op, inputs, grad_out)
    ref, ref_grads = _reference(op, inputs, grad_out)  # exp(<= 100) is finite in float64
    assert torch.isfinite(ref).all()
    assert _rel(out, ref) < 1e-4
    for name in "QKV":
        assert _rel(grads[name], ref_grads[name]) < 1e-4, name


@pytest.mark.parametrize(("name", "a1", "sign"), [("softmin_trust", "exp(-x)", -1.0),
                                                   ("softmax_trust", "exp(x)", 1.0)])
def test_exponential_maps_stay_finite_at_scores_of_1e3(tmp_path, op_cache, name, a1, sign):
    op = _load(_spec(tmp_path, name, a1), op_cache)
    generator = torch.Generator().manual_seed(2)
    inputs = _large_scores(generator)
    grad_out = torch.randn(1, 2, 13, 8, generator=generator)
    with raise_float_errors():
        out, grads = _run(op, inputs, grad_out)
    # float64 exp overflows past 709, so the reference here is the max-shifted softmax in float64
    leaves = {n: t.double().requires_grad_() for n, t in inputs.items()}
    scores = sign * (leaves["Q"] @ leaves["K"].transpose(-1, -2)) * 8**-0.5
    ref = torch.softmax(scores, -1) @ leaves["V"]
    ref_grads = torch.autograd.grad(ref, list(leaves.values()), grad_out.double())
    assert _rel(out, ref) < 1e-5
    # At |s| ~ 1e3 the rows are nearly one-hot and the gradients tiny (~1e-6): dS = P (dP - delta), with delta from
    # dO . o as in FlashAttention, cancels, and the scores' fp32 rounding (~1e-4 absolute) shows. Measured: 6e-4
    # (softmin, pre-map path) and 1.3e-3 (plain softmax, exp2 path); PyTorch's fp32 softmax 4e-5.
    for grad, ref_grad, name_ in zip(grads.values(), ref_grads, "QKV", strict=True):
        assert torch.isfinite(grad).all() and _rel(grad, ref_grad) < 5e-3, name_


@pytest.mark.parametrize(("a1", "a2", "b", "why"), [
    ("x^2 * exp(x)", None, "z", "not of the form"),
    ("exp(x) + 1", None, "z", "not of the form"),
    ("exp(x)", "x", "z", "grows exponentially"),
    ("exp(tanh(x))", "exp(x^2)", "z", "not positive multiples"),
    ("exp(-x)", None, "z^2", "not homogeneous"),
    ("exp(1 / x)", None, "z", "not of the form"),
])
def test_unstabilisable_exponentials_are_rejected_with_the_reason(tmp_path, a1, a2, b, why):
    path = _spec(tmp_path, "bad_exponential", a1, a2, b)
    with pytest.raises(NcdError) as err:
        plan(ncd.load_spec(path))
    message = str(err.value)
    assert why in message and "bad_exponential.ncd:12" in message, message


def test_bounded_maps_with_exponentials_still_stream_without_a_max(tmp_path):
    cert = plan(ncd.load_spec(_spec(tmp_path, "sig", "sigmoid(x)"))).certificate
    assert cert.rescale is None and cert.pre == X


# ---------------------------------------------------------------------------------------------------------------
# 7. masked rows: output 0 and zero gradients, in every kernel form and in the reference
# ---------------------------------------------------------------------------------------------------------------

WEIGHTED = "in  M[batch key] : f32\n"


def _masked_case(generator, n=11, d=8, padding=3):
    inputs = _qkv(generator, n=n, d=d)
    weight = torch.rand(1, n, generator=generator) + 0.5
    weight[:, :padding] = 0.0  # causal rows 0..padding-1 see only zero-weight keys
    return {**inputs, "M": weight}


@pytest.mark.parametrize(("a1", "a2", "b", "form"), [
    ("exp(x)", None, "z", "streamed"),
    ("x", "x^2", "sqrt(z)", "streamed"),
    ("x", "x^2", "sqrt(z)", "factorized"),
    ("exp(100 * tanh(x / 100))", None, "z", "streamed"),
])
@pytest.mark.parametrize("causal", [True, False])
def test_masked_rows_are_zero_with_zero_gradients(tmp_path, op_cache, monkeypatch, a1, a2, b, form, causal):
    mask = ", mask = key <= query" if causal else ""
    op = _load(_spec(tmp_path, f"masked_{'causal' if causal else 'full'}", a1, a2, b, extra=WEIGHTED,
                     options=f"{mask}, weight = M", score="Q . K over dim"), op_cache)
    if form == "factorized":
        op = op.with_config(factorize="always")
    generator = torch.Generator().manual_seed(3)
    inputs = _masked_case(generator)
    if not causal:
        inputs["M"][:] = 0.0  # every row masked
    grad_out = torch.randn(1, 2, 11, 8, generator=generator)
    with raise_float_errors():
        out, grads = _run(op, inputs, grad_out)
    ref, ref_grads = _reference(op, inputs, grad_out)
    masked = slice(0, 3) if causal else slice(None)
    assert torch.isfinite(ref).all() and (ref[:, :, masked] == 0).all()
    assert (out[:, :, masked] == 0).all() and torch.isfinite(out).all()
    assert (grads["Q"][:, :, masked] == 0).all()
    assert (grads["K"][:, :, :3] == 0).all() and (grads["V"][:, :, :3] == 0).all()  # the padding keys
    if causal:
        assert _rel(out, ref) < 1e-4
        for name in "QKV":
            assert _rel(grads[name], ref_grads[name]) < 1e-4, name
    else:
        assert all((g == 0).all() for g in grads.values())


# ---------------------------------------------------------------------------------------------------------------
# 5. inputs whose gradient the kernels do not compute fail at the call; so does double backward
# ---------------------------------------------------------------------------------------------------------------

def _shipped(stem, cache):
    return _load(ROOT / "specs" / f"{stem}.ncd", cache)


def _gqa_inputs(generator, n=9, d=128):
    q = torch.randn(1, 4, n, d, generator=generator)
    k, v = (torch.randn(1, 2, n, d, generator=generator) for _ in range(2))
    return q, k, v, torch.rand(1, n, generator=generator) + 0.5


@pytest.mark.parametrize("form", ["never", "always"])
def test_weight_that_requires_grad_gets_its_gradient(op_cache, monkeypatch, form):
    """specs/causal_gqa_spherical.ncd: M.grad used to stay None. Streamed and factorized forms."""
    op = _shipped("causal_gqa_spherical", op_cache).with_config(factorize=form)
    generator = torch.Generator().manual_seed(5)
    inputs = dict(zip("QKVM", _gqa_inputs(generator), strict=True))
    grad_out = torch.randn(1, 4, 9, 128, generator=generator)
    with raise_float_errors():
        out, grads = _run(op, inputs, grad_out, tuple("QKVM"))
    ref, ref_grads = _reference(op, inputs, grad_out, tuple("QKVM"))
    assert _rel(out, ref) < 1e-5
    for name in "QKVM":
        assert _rel(grads[name], ref_grads[name]) < 1e-4, name
    assert float(ref_grads["M"].abs().min()) > 0  # a gradient to get right, on every key


@pytest.mark.parametrize(("a1", "b"), [("exp(x)", "z"), ("exp(100 * tanh(x / 100))", "z"), ("sigmoid(x)", "z")])
def test_weight_gradient_with_exponential_and_bounded_maps(tmp_path, op_cache, a1, b):
    op = _load(_spec(tmp_path, "weighted", a1, None, b, extra=WEIGHTED, options=", mask = key <= query, weight = M",
                     score="Q . K over dim"), op_cache)
    generator = torch.Generator().manual_seed(9)
    inputs = {**_qkv(generator, n=11, d=8), "M": torch.rand(1, 11, generator=generator) + 0.5}
    inputs["Q"] = inputs["Q"] * 3  # scores of a few units: the rescale matters
    grad_out = torch.randn(1, 2, 11, 8, generator=generator)
    with raise_float_errors():
        out, grads = _run(op, inputs, grad_out, tuple("QKVM"))
    ref, ref_grads = _reference(op, inputs, grad_out, tuple("QKVM"))
    assert _rel(out, ref) < 1e-5
    for name in "QKVM":
        assert _rel(grads[name], ref_grads[name]) < 1e-4, name
    assert float(ref_grads["M"].abs().min()) > 0  # a gradient to get right, on every key


@pytest.mark.parametrize(("score", "a1", "a2", "b", "form"), [
    ("(2 * scale) * (Q . K over dim)", "exp(x)", None, "z", "never"),
    ("scale * (Q . K over dim)", "exp(100 * tanh(x / 100))", None, "z", "never"),
    ("scale * (Q . K over dim)", "x", "x^2 + 1", "sqrt(z)", "always"),  # the factorized form
])
def test_scale_tensor_that_requires_grad_gets_its_gradient(tmp_path, op_cache, monkeypatch, score, a1, a2, b, form):
    op = _load(_spec(tmp_path, "grad_scale", a1, a2, b, score=score, extra="in  scale : f32\n"), op_cache)
    if op.config.factorized:
        op = op.with_config(factorize=form)
    elif form == "always":
        pytest.fail("the polynomial maps must have a factorized form")
    generator = torch.Generator().manual_seed(6)
    inputs = {**_qkv(generator, n=9, d=8), "scale": torch.tensor(0.3)}
    grad_out = torch.randn(1, 2, 9, 8, generator=generator)
    names = ("Q", "K", "V", "scale")
    with raise_float_errors():
        out, grads = _run(op, inputs, grad_out, names)
    ref, ref_grads = _reference(op, inputs, grad_out, names)
    assert _rel(out, ref) < 1e-5
    for name in names:
        assert _rel(grads[name], ref_grads[name]) < 1e-4, name
    assert float(grads["scale"].abs()) > 0


def test_scale_tensor_under_a_function_must_be_detached(tmp_path, op_cache):
    """sqrt(scale) is evaluated with math.sqrt, which would drop a tensor's gradient: the call says so instead."""
    op = _load(_spec(tmp_path, "sqrt_scale", "exp(x)", score="sqrt(scale) * (Q . K over dim)",
                     extra="in  scale : f32\n"), op_cache)
    q, k, v = _qkv(torch.Generator().manual_seed(6), n=5, d=8).values()
    with pytest.raises(CallError, match=r"scale requires grad.*constant.*scale\.detach\(\)"):
        op(q, k, v, torch.tensor(0.1, requires_grad=True))
    torch.testing.assert_close(op(q, k, v, torch.tensor(0.1)), op(q, k, v, 0.1))


@pytest.mark.parametrize("factorize", ["never", "always"])
def test_double_backward_raises(op_cache, monkeypatch, factorize):
    op = _shipped("spherical_attention", op_cache).with_config(factorize=factorize)
    generator = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 7, 128, generator=generator, requires_grad=True) for _ in range(3))
    out = op(q, k, v)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(out.square().sum(), q, create_graph=True)


# ---------------------------------------------------------------------------------------------------------------
# 12. scale expressions and size() inside a map compile (folded into the score's scale)
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("score", "a1", "extra", "factor"), [
    ("(2 * scale) * (Q . K over dim)", "exp(x)", "in  scale : f32 = 0.25\n", 0.5),
    ("Q . K over dim", "exp(x / sqrt(size(dim)))", "", 8**-0.5),
    ("(Q . K over dim) / sqrt(size(dim))", "exp(x)", "", 8**-0.5),
    ("scale * (Q . K over dim)", "exp(x * size(dim) / 4)", "in  scale : f32 = 0.25\n", 0.5),
])
def test_scale_expressions_and_sizes_in_maps_compile(tmp_path, op_cache, score, a1, extra, factor):
    op = _load(_spec(tmp_path, "scaled", a1, score=score, extra=extra), op_cache)
    generator = torch.Generator().manual_seed(8)
    inputs = _qkv(generator, n=7, d=8)
    grad_out = torch.randn(1, 2, 7, 8, generator=generator)
    with raise_float_errors():
        out, grads = _run(op, inputs, grad_out)
    ref, ref_grads = _reference(op, inputs, grad_out)
    assert _rel(out, ref) < 1e-5
    for name in "QKV":
        assert _rel(grads[name], ref_grads[name]) < 1e-4, name
    # and the scale is the one the spec says: softmax(factor * q.k)
    expected = torch.softmax(factor * inputs["Q"].double() @ inputs["K"].double().transpose(-1, -2), -1)
    assert _rel(out, expected @ inputs["V"].double()) < 1e-5


# ---------------------------------------------------------------------------------------------------------------
# 13. empty sizes, meta tensors and a scale of the wrong shape at the call
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stem", ["softmax_attention", "causal_gqa_spherical"])
@pytest.mark.parametrize("empty", ["batch", "heads", "queries", "keys"])
def test_empty_sizes_give_empty_results_and_gradients(op_cache, stem, empty):
    op = _shipped(stem, op_cache)
    b, n_q, n_k = (0 if empty == "batch" else 2), (0 if empty == "queries" else 5), (0 if empty == "keys" else 5)
    gqa = stem == "causal_gqa_spherical"
    heads = 0 if empty == "heads" else 2
    q = torch.randn(b, 2 * heads if gqa else heads, n_q, 128, requires_grad=True)
    k, v = (torch.randn(b, heads, n_k, 128, requires_grad=True) for _ in range(2))
    args = (q, k, v, torch.ones(b, n_k)) if gqa else (q, k, v)
    if empty == "queries" and gqa:  # the causal mask needs a key per query here; equal lengths
        args = (q, k[:, :, :0].detach().requires_grad_(), v[:, :, :0].detach().requires_grad_(), torch.ones(b, 0))
    out = op(*args)
    assert out.shape == (q.shape[0], q.shape[1], q.shape[2], 128) and not out.isnan().any()
    assert (out == 0).all()
    grads = torch.autograd.grad(out.sum(), args[:3])
    for grad, x in zip(grads, args[:3], strict=True):
        assert grad.shape == x.shape and (grad == 0).all()


def test_meta_tensors_are_named(op_cache):
    op = _shipped("softmax_attention", op_cache)
    q = torch.randn(1, 2, 5, 128)
    with pytest.raises(CallError, match="K is a meta tensor"):
        op(q, torch.empty(1, 2, 5, 128, device="meta"), q)


def test_meta_tensors_are_named_in_every_family(op_cache):
    op = _shipped("group_rational", op_cache)
    with pytest.raises(CallError, match="x is a meta tensor"):
        op(torch.empty(3, 16, device="meta"), torch.randn(8, 6), torch.randn(8, 4))


@pytest.mark.parametrize("bad", [torch.tensor([0.1, 0.2]), "0.1", None])
def test_scale_of_the_wrong_shape_is_named(op_cache, bad):
    op = _shipped("softmax_attention", op_cache)
    q = torch.randn(1, 2, 5, 128)
    if bad is None:  # None means: the default 1 / sqrt(size(dim))
        torch.testing.assert_close(op(q, q, q, None), op(q, q, q, 128**-0.5))
        return
    with pytest.raises(CallError, match=r"scale must be a number or a one-element tensor"):
        op(q, q, q, bad)


def test_size_in_the_normaliser_is_a_located_error(tmp_path):
    """Attention cannot stream a normaliser that reads the key count: it says where, and the spec falls through
    to the generic family (which computes it as written)."""
    path = _spec(tmp_path, "size_in_b", "x", "x^2", "sqrt(z / size(key))", score="Q . K over dim", extra="")
    front = ncd.load_spec(path)
    with pytest.raises(NcdError) as err:
        plan_attention(front, {})
    assert "size_in_b.ncd:11:27" in str(err.value) and "reads key" in str(err.value)
    with pytest.warns(FallbackWarning, match="attention: size_in_b.ncd:11:27"):
        assert select(front).family.name == "generic"
