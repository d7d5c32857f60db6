"""Issue 32, item 3: Q/K (and V) transforms as a prologue of the attention op (ncd/families/attention/prologue.py):
QK-norm, cosine attention and feature maps compile to the attention kernels, with the transform computed in
PyTorch before them, differentiated by autograd (gradients into Q, K, V and the transform's parameters), against the
float64 reference; transforms that are not per-row fall to the generic family with the place and the reason."""

from __future__ import annotations

import math

import pytest
import torch

import ncd
from ncd.reference import evaluate
from ncd.validate import validate

from .conftest import ROOT

# Odd sizes: 37 queries, 29 keys, head dim 40 (tiled at 64), 3 heads
SIZES = {"batch": 2, "head": 3, "query": 37, "key": 29}

QK_NORM = """\
spec qk_norm
axis batch, head, query, key
axis dim = 40
in    Q[batch head query dim] : f32
in    K[batch head key dim]   : f32
in    V[batch head key dim]   : f32
param gq[dim] : f32
param gk[dim] : f32
in    scale : f32 = 1 / sqrt(size(dim))
Qn[batch head query dim] = gq * Q / sqrt(sum(Q * Q, over dim) / size(dim) + 1e-6)
Kn[batch head key dim]   = gk * K / sqrt(sum(K * K, over dim) / size(dim) + 1e-6)
S[batch head query key]  = scale * (Qn . Kn over dim)
A[batch head query key]  = normalize(S, over key, a1(x) = exp(x), a2(x) = exp(x), b(z) = z, mask = key <= query)
out O[batch head query dim] = A . V over key
"""

# grouped K/V heads (two query heads per K/V head), cosine attention with a per-head temperature, and a transform
# of V (a learned per-channel gain through a sigmoid)
GQA_COSINE = """\
spec gqa_cosine
axis batch, query, key
axis kvhead, qgroup
axis head = kvhead * qgroup
axis dim = 40
in    Q[batch head query dim]  : f32
in    K[batch kvhead key dim]  : f32
in    V[batch kvhead key dim]  : f32
param tau[head] : f32
param gv[dim]   : f32
Qn[batch head query dim]  = Q / sqrt(max(sum(Q * Q, over dim), 1e-12))
Kn[batch kvhead key dim]  = K / sqrt(max(sum(K * K, over dim), 1e-12))
Vn[batch kvhead key dim]  = sigmoid(gv) * V
S[batch head query key]   = tau * (Qn . Kn over dim)
A[batch head query key]   = normalize(S, over key, a1(x) = exp(x), a2(x) = exp(x), b(z) = z)
out O[batch head query dim] = A . Vn over key
"""


def _write(tmp_path, text: str, name: str):
    path = tmp_path / f"{name}.ncd"
    path.write_text(text)
    return path


def _shipped(stem: str, tmp_path, dim: int = 24):
    """A shipped spec at a smaller head dim (the interpreter's cost grows with it)."""
    text = (ROOT / "specs" / f"{stem}.ncd").read_text().replace("axis dim = 128", f"axis dim = {dim}")
    assert f"axis dim = {dim}" in text
    return _write(tmp_path, text, stem)


def _leaves(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g).requires_grad_() for n, s in shapes.items()}


def _reference(program, leaves: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The float64 reference of the spec's IR and its gradients (the loss sum(O * W) with a fixed W)."""
    inputs = {n: t.detach().double().requires_grad_() for n, t in leaves.items()}
    out = evaluate(program, inputs)[program.outputs[0].name]
    weight = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view(out.shape)
    return out, list(torch.autograd.grad((out * weight).sum(), list(inputs.values())))


def _close(got: torch.Tensor, want: torch.Tensor, name: str, tol: float = 1e-4) -> None:
    assert not got.isnan().any(), f"{name}: NaN (an unwritten, poisoned output?)"
    error = ((got.double() - want).norm() / want.norm()).item()
    assert error < tol, f"{name}: relative error {error:.2e} >= {tol}"


def test_qk_norm_compiles_to_the_attention_kernels_and_matches_float64(tmp_path):
    """RMS QK-norm with gains at odd sizes (37 queries, 29 keys, head dim 40, 3 heads): the attention family claims
    it; forward and the gradients of Q, K, V, gq and gk against the float64 reference of the spec, and the forward
    against the formula written out in float64 (NaN-poisoned kernel outputs: conftest)."""
    op = ncd.load(_write(tmp_path, QK_NORM, "qk_norm"))
    assert op.plan.family == "attention"
    assert [(t.role, t.name, t.reads) for t in op.plan.roles.prologue] == [
        ("Q", "Qn", ("Q", "gq")), ("K", "Kn", ("K", "gk"))]
    b, h, nq, nk, d = 2, 3, 37, 29, 40
    leaves = _leaves({"Q": (b, h, nq, d), "K": (b, h, nk, d), "V": (b, h, nk, d), "gq": (d,), "gk": (d,)}, 0)
    out = op(*leaves.values())
    want, grads = _reference(op.front.program, leaves)
    _close(out, want, "O")
    weight = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view(out.shape)
    got = torch.autograd.grad((out * weight.float()).sum(), list(leaves.values()))
    for name, g, w in zip(leaves, got, grads, strict=True):
        _close(g, w, f"d{name}")
    # the math itself, independently of the reference evaluator
    q, k, v, gq, gk = (t.detach().double() for t in leaves.values())
    qn = gq * q / (q.square().mean(-1, keepdim=True) + 1e-6).sqrt()
    kn = gk * k / (k.square().mean(-1, keepdim=True) + 1e-6).sqrt()
    s = (qn @ kn.transpose(-1, -2)) / math.sqrt(d)
    s = s.masked_fill(torch.ones(nq, nk, dtype=torch.bool).tril().logical_not(), -math.inf)
    _close(out, torch.softmax(s, -1) @ v, "O (written out)")


def test_grouped_heads_cosine_attention_and_a_value_transform_match_float64(tmp_path):
    """GQA (2 K/V heads, 2 query heads each: K's transform over kvhead), l2-normalised q and k with a learned
    per-head temperature, and a transform of V: every gradient, tau's and gv's included (the checker's default
    case at odd sizes)."""
    op = ncd.load(_write(tmp_path, GQA_COSINE, "gqa_cosine"))
    assert op.plan.family == "attention"
    assert [t.role for t in op.plan.roles.prologue] == ["Q", "K", "V"]
    rows = validate(op, torch.float32, seed=3)
    assert {r.quantity for r in rows} == {"O", "dQ", "dK", "dV", "dtau", "dgv"}
    for row in rows:
        assert row.ok and row.error > 0, row


@pytest.mark.parametrize("stem", ["qk_norm_softmax", "cosine_attention", "feature_map_softmax"])
def test_shipped_prologue_specs_pass_ncd_check(stem, tmp_path, run_cli):
    """`ncd check` (every draw: large scores, exact zeros in q and k, bf16) on the shipped specs, at head dim 24."""
    code, out, err = run_cli("check", str(_shipped(stem, tmp_path)))
    assert code == 0, out + err
    assert "(attention)" in out and "numerics" in out and "FAIL" not in out


def test_emit_plan_names_each_transform_with_its_spec_line(run_cli):
    code, out, err = run_cli("compile", str(ROOT / "specs" / "qk_norm_softmax.ncd"), "--emit", "plan")
    assert code == 0, err
    assert "  Q = Qn[batch head query dim]  K = Kn[batch head key dim]  V = V[batch head key dim]" in out
    assert ("  prologue (PyTorch before the kernels, autograd): Q <- Qn[batch head query dim] = gq * Q / "
            "sqrt(sum(Q * Q, over dim) / size(dim) + 1e-6)  # qk_norm_softmax.ncd:19") in out
    assert "K <- Kn[batch head key dim] = gk * K / sqrt(sum(K * K, over dim) / size(dim) + 1e-6)" in out


HEADER = """\
spec t
axis batch, head, query, key
axis dim = 16
in    Q[batch head query dim] : f32
in    K[batch head key dim]   : f32
in    V[batch head key dim]   : f32
param gq[dim] : f32
"""
SCORE = """\
S[batch head query key] = Qn . K over dim
A[batch head query key] = normalize(S, over key, a1(x) = exp(x), a2(x) = exp(x), b(z) = z)
out O[batch head query dim] = A . V over key
"""


@pytest.mark.parametrize(("transform", "where", "reason"), [
    ("Qn[batch head query dim] = Q + sum(K, over key) / size(key)", "8:36",
     "the transform of Q ('Qn') reads a wire over 'key', which Q [batch head query dim] lacks"),
    ("Qn[batch head query dim] = Q - sum(Q, over query) / size(query)", "8:32",
     "the transform of Q ('Qn') reduces over 'query'; an attention prologue reduces only over the feature axis "
     "'dim' (row-wise)"),
    ("Qn[batch head query dim] = gq * normalize(Q, over dim, a1(x) = x, a2(x) = x^2, b(z) = sqrt(z))", "8:33",
     "the transform of Q ('Qn') holds a normalize"),
])
def test_a_transform_that_is_not_per_row_falls_to_generic_with_its_place(tmp_path, run_cli, transform, where,
                                                                         reason):
    """Reading the key axis for q, reducing over the sequence, or a normalize inside: the attention family says
    where and why, and the generic family compiles the spec."""
    path = _write(tmp_path, HEADER + transform + "\n" + SCORE, "t")
    code, out, err = run_cli("compile", str(path), "--emit", "plan")
    assert code == 0, err
    assert out.startswith("family: generic")
    assert f"declined by attention: t.ncd:{where}: recognised, but: {reason}" in out


def test_an_unnamed_transform_says_to_name_it(tmp_path, run_cli):
    body = SCORE.replace("Qn . K over dim", "(gq * Q) . K over dim")
    code, out, err = run_cli("compile", str(_write(tmp_path, HEADER + body, "t")), "--emit", "plan")
    assert code == 0, err
    assert "declined by attention: t.ncd:8:28: recognised, but: the attention kernels read Q directly" in out
    assert out.startswith("family: generic")
    from ncd.families.attention.plan import UnsupportedAttention, plan_attention

    with pytest.raises(UnsupportedAttention, match="compute it in a named intermediate from inputs"):
        plan_attention(ncd.load_spec(tmp_path / "t.ncd"), {})


def test_the_op_with_a_prologue_traces_under_torch_compile(tmp_path):
    """torch.compile(fullgraph=True) traces the prologue's PyTorch ops with the attention custom op: the eager op's
    output and gradients (gq's and gk's included)."""
    op = ncd.load(_write(tmp_path, QK_NORM.replace("axis dim = 40", "axis dim = 16"), "qk_norm16"))
    g = torch.Generator().manual_seed(4)
    tensors = [torch.randn(s, generator=g) for s in ((1, 2, 11, 16), (1, 2, 9, 16), (1, 2, 9, 16), (16,), (16,))]
    results = []
    for fn in (op, torch.compile(lambda *a: op(*a), fullgraph=True, backend="aot_eager")):
        leaves = [t.clone().requires_grad_() for t in tensors]
        out = fn(*leaves)
        results.append((out, *torch.autograd.grad(out.square().sum(), leaves)))
    for eager, traced in zip(*results, strict=True):
        assert not eager.isnan().any()
        torch.testing.assert_close(traced, eager, rtol=1e-6, atol=1e-6)


def test_call_time_checks_cover_the_prologue_inputs(tmp_path):
    """The raw Q keeps the op's checks: a wrong head dim is named by the shared check, a dtype that differs from
    V's by the prologue's."""
    from ncd.errors import CallError

    op = ncd.load(_write(tmp_path, QK_NORM.replace("axis dim = 40", "axis dim = 16"), "qk_norm16"))
    q, k, v = (torch.randn(1, 2, 5, 16) for _ in range(3))
    gq, gk = torch.ones(16), torch.ones(16)
    with pytest.raises(CallError, match="axis 'dim'"):
        op(q[..., :8], k, v, gq, gk)
    with pytest.raises(CallError, match=r"Q has dtype torch\.bfloat16 but V has torch\.float32"):
        op(q.bfloat16(), k, v, gq, gk)
    with pytest.raises(CallError, match=r"gq has dtype torch\.int64"):
        op(q, k, v, gq.long(), gk)


def test_generated_prologue_is_written_from_the_ir(tmp_path):
    """The prologue's code is the generic family's emitter's: one line per node with its origin, computed in fp32,
    handed over in the kernels' dtype; no spec text besides names and numbers."""
    op = ncd.load(_write(tmp_path, QK_NORM, "qk_norm"))
    source = op.compiled.code
    assert "def _prologue_body(_dtype, Q, K, gq, gk):" in source
    assert "Qn = " in source and "# qk_norm.ncd:10" in source
    assert "return Qn.to(_dtype), Kn.to(_dtype)  # qk_norm.ncd:10, qk_norm.ncd:11" in source
    assert "Qn, Kn = _prologue(_dtype, Q, K, gq, gk)" in source


def test_the_prologue_runs_through_torch_compile_where_the_module_says(tmp_path, monkeypatch):
    """PROLOGUE_COMPILE (from NCD_GENERIC_COMPILE: CUDA tensors by default) sends eager calls through
    torch.compile(fullgraph=True) of the prologue; forced here on the CPU with the aot_eager backend, the output and
    gradients are the eager prologue's."""
    op = ncd.load(_write(tmp_path, QK_NORM.replace("axis dim = 40", "axis dim = 16"), "qk_norm_compiled"))
    assert op.module.PROLOGUE_COMPILE == "cuda"
    monkeypatch.setattr(op.module, "_PROLOGUE_COMPILED", {})
    monkeypatch.setattr(op.module, "PROLOGUE_COMPILE_BACKEND", "aot_eager")
    g = torch.Generator().manual_seed(6)
    tensors = [torch.randn(s, generator=g) for s in ((1, 2, 7, 16), (1, 2, 5, 16), (1, 2, 5, 16), (16,), (16,))]
    results = []
    for mode in ("cuda", "always"):  # (on the CPU: eager, then compiled)
        monkeypatch.setattr(op.module, "PROLOGUE_COMPILE", mode)
        leaves = [t.clone().requires_grad_() for t in tensors]
        out = op(*leaves)
        results.append((out, *torch.autograd.grad(out.sum(), leaves)))
    assert list(op.module._PROLOGUE_COMPILED) == ["aot_eager"]
    for eager, compiled in zip(*results, strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)


def test_a_transform_reading_a_scalar_input_and_a_call_time_head_dim(tmp_path):
    """RMS norm with `eps` a scalar input (its default, or a value at the call) and the head dim bound at call time
    (size(dim) from the transform's own argument): the checker's default case, and the scalar reaching the prologue."""
    text = QK_NORM.replace("axis dim = 40", "axis dim").replace("in    scale", "in    eps : f32 = 1e-6\nin    scale")
    op = ncd.load(_write(tmp_path, text.replace("size(dim) + 1e-6)", "size(dim) + eps)"), "qk_norm_eps"))
    assert op.plan.family == "attention" and op.plan.roles.prologue[0].reads == ("Q", "gq", "eps")
    for row in validate(op, torch.float32, seed=2):
        assert row.ok, row
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 5, 24, generator=g) for _ in range(3))
    ones = torch.ones(24)
    assert not torch.equal(op(q, k, v, ones, ones), op(q, k, v, ones, ones, eps=10.0))


SPHERICAL_QK_NORM = """\
spec spherical_qk_norm
axis batch, head, query, key
axis dim = 24
in    Q[batch head query dim] : f32
in    K[batch head key dim]   : f32
in    V[batch head key dim]   : f32
param gq[dim] : f32
Qn[batch head query dim] = gq * Q / sqrt(sum(Q * Q, over dim) / size(dim) + 1e-6)
S[batch head query key]  = Qn . K over dim
A[batch head query key]  = normalize(S, over key, a1(x) = x, a2(x) = x^2, b(z) = sqrt(z), mask = key <= query)
out O[batch head query dim] = A . V over key
"""


def test_a_bare_score_of_a_normalised_q_is_a_score_not_a_normalisation(tmp_path):
    """`S = Qn . K over dim` with Qn = q / rms(q): the streaming pass does not take the norm's sum over dim for a
    spelled-out normaliser of S (it normalises no scores), so causal spherical attention claims the spec, with its
    factorized form; the validation's redraw of near-singular rows (b = sqrt has a zero) redraws rows of Q, the
    transform's input, and the default case matches float64 with every gradient."""
    op = ncd.load(_write(tmp_path, SPHERICAL_QK_NORM, "spherical_qk_norm"))
    assert op.plan.family == "attention" and op.plan.factorization is not None
    program, plan = op.front.program, op.plan
    g = torch.Generator().manual_seed(0)
    inputs = {"Q": torch.randn(1, 1, 6, 24, generator=g), "K": torch.randn(1, 1, 6, 24, generator=g),
              "V": torch.randn(1, 1, 6, 24, generator=g), "gq": torch.ones(24)}
    q0, k0 = inputs["Q"][0, 0, 0], inputs["K"][0, 0, 0]
    q0 -= (q0 @ k0) / (k0 @ k0) * k0  # the first query row's only score s_00 ~ 1e-7
    conditioned = plan.condition_inputs(program, inputs, torch.Generator().manual_seed(1))
    assert not torch.equal(conditioned["Q"][0, 0, 0], inputs["Q"][0, 0, 0])  # the first row (b = |s_00|) redrawn
    assert torch.equal(conditioned["Q"][0, 0, 1:], inputs["Q"][0, 0, 1:])
    for row in validate(op, torch.float32, seed=4):
        assert row.ok, row
