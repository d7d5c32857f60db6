"""CPU tests of the generated attention kernels, run through the Triton interpreter."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

import ast
import dataclasses
import hashlib
import math

import pytest
import torch

from ncd.families.attention.plan import plan_attention
from ncd.families.attention.render import AttentionKernelSpec, AttentionSpecError, render_attention_module, spec_config
from ncd.families.attention.render_op import kernel_spec
from ncd.ops import import_generated
from ncd.pipeline import front_end

# Padding query rows past Nq compute 0/0 (spherical with q = 0) in the interpreter; they are never stored.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")

# Each family: the spec's normalize functions (compiled, derivatives from sympy) and torch maps for the
# independent float64 reference below.
FAMILIES = {
    "spherical": ("a1(x) = x, a2(x) = x^2, b(z) = sqrt(z)", lambda s: s, lambda s: s * s, torch.sqrt),
    "softmax": ("a1(x) = exp(x), a2(x) = exp(x), b(z) = z", torch.exp, torch.exp, lambda z: z),
    "sigmoid": ("a1(x) = sigmoid(x), a2(x) = sigmoid(x), b(z) = z", torch.sigmoid, torch.sigmoid, lambda z: z),
    "signed_l1": ("a1(x) = x, a2(x) = abs(x), b(z) = z", lambda s: s, torch.abs, lambda z: z),
}


# Polynomial maps of degree <= 1, <= 2 with every coefficient non-zero (the factorized form's vector and weight
# sums), and linear attention with a constant term, for the factorized kernels.
POLYNOMIAL_FAMILIES = {
    "poly": ("a1(x) = 0.5 - 2*x, a2(x) = 1 + x + 3*x^2, b(z) = sqrt(z)", lambda s: 0.5 - 2 * s,
             lambda s: 1 + s + 3 * s * s, torch.sqrt),
    "linear": ("a1(x) = x, a2(x) = 1 + x, b(z) = z", lambda s: s, lambda s: 1 + s, lambda z: z),
}


def _front(family: str, causal: bool, has_weight: bool):
    extras = (", mask = key <= query" if causal else "") + (", weight = M" if has_weight else "")
    maps = {**FAMILIES, **POLYNOMIAL_FAMILIES}[family][0]
    text = f"""spec {family}
axis batch, kvhead, qgroup, query, key
axis head = kvhead * qgroup
axis dim
in Q[batch head query dim] : f32
in K[batch kvhead key dim] : f32
in V[batch kvhead key dim] : f32
{"in M[batch key] : f32" if has_weight else ""}
S[batch head query key] = Q . K over dim
A[batch head query key] = normalize(S, over key, {maps}{extras})
out O[batch head query dim] = A . V over key
"""
    front = front_end(text, f"{family}.ncd")
    plan = plan_attention(front, {})
    assert plan is not None
    return front, plan


def compiled_kernel_spec(family: str, causal: bool = False, has_weight: bool = False) -> AttentionKernelSpec:
    """The kernel spec the compiler derives from a small attention spec of this family."""
    front, plan = _front(family, causal, has_weight)
    return kernel_spec(family, plan.certificate, plan.roles, plan.maps, front.program)


def load_attention_module(spec: AttentionKernelSpec, cache_dir, **config):
    """The generated module of `spec`; keyword arguments override fields of its config (AttentionConfig)."""
    text = render_attention_module(spec, config=dataclasses.replace(spec_config(spec), **config))
    ident = f"kernels_{spec.name}_{hashlib.sha256(text.encode()).hexdigest()[:12]}"
    return import_generated(ident, lambda: text, cache_dir)[0]


def spherical_spec(causal=False, has_weight=False):
    return compiled_kernel_spec("spherical", causal, has_weight)


def softmax_spec(causal=False, has_weight=False):
    return compiled_kernel_spec("softmax", causal, has_weight)


def reference(family, q, k, v, w, scale, causal):
    """float64 eager reference of o_i = sum_j w_j a1(s_ij) v_j / b(sum_j w_j a2(s_ij))."""
    _, a1, a2, b = {**FAMILIES, **POLYNOMIAL_FAMILIES}[family]
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = scale * q @ k.transpose(-1, -2)
    weight = torch.ones(s.shape[-1], dtype=s.dtype) if w is None else w[:, None, None, :]
    visible = torch.ones(s.shape[-2:], dtype=torch.bool)
    if causal:
        visible = torch.tril(visible)
    # evaluate the maps on visible entries only (softmax of a masked score must not overflow)
    s = torch.where(visible, s, torch.zeros_like(s))
    p1 = torch.where(visible, a1(s), torch.zeros_like(s)) * weight
    p2 = torch.where(visible, a2(s), torch.zeros_like(s)) * weight
    return (p1 @ v) / b(p2.sum(-1, keepdim=True))


def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def _inputs(batch, hq, hkv, n_q, n_k, dim, dtype, weight, noncontiguous):
    if noncontiguous:  # [B, N, H, D] storage viewed as [B, H, N, D]
        q = torch.randn(batch, n_q, hq, dim).transpose(1, 2)
        k = torch.randn(batch, n_k, hkv, dim).transpose(1, 2)
        v = torch.randn(batch, n_k, hkv, dim).transpose(1, 2)
    else:
        q, k, v = (torch.randn(batch, h, n, dim) for h, n in ((hq, n_q), (hkv, n_k), (hkv, n_k)))
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    w = torch.rand(batch, n_k) * 2.0 + 0.1 if weight else None
    return q, k, v, w


CASES = [
    # family, causal, weight, (B, Hq, Hkv, Nq, Nk, D), dtype, noncontiguous
    *[(f, False, False, (2, 4, 2, 37, 29, 16), torch.float32, True) for f in FAMILIES],
    *[(f, True, False, (2, 4, 2, 37, 29, 16), torch.float32, False) for f in FAMILIES],
    *[(f, False, True, (2, 4, 2, 37, 29, 16), torch.float32, False) for f in FAMILIES],
    ("softmax", True, True, (1, 2, 1, 20, 45, 32), torch.float32, False),
    ("spherical", True, True, (1, 2, 2, 45, 20, 32), torch.float32, True),
    ("spherical", False, False, (1, 4, 1, 33, 40, 32), torch.bfloat16, False),
]


def _case_id(case):
    family, causal, weight, shape, dtype, noncontig = case
    parts = [family, "causal" if causal else "full", "w" if weight else "now", "x".join(map(str, shape))]
    parts.append(str(dtype).removeprefix("torch."))
    if noncontig:
        parts.append("strided")
    return "-".join(parts)


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_forward_and_gradients_match_float64_reference(case, tmp_path, monkeypatch):
    family, causal, weight, (batch, hq, hkv, n_q, n_k, dim), dtype, noncontig = case
    # the dQ kernel that recomputes S and dP (no stored-dS buffer); DS_CASES test the stored-dS one
    module = load_attention_module(compiled_kernel_spec(family, causal, weight), tmp_path, ds_buffer_bytes=0)
    assert module.CONFIG.ds_buffer_bytes == 0 and "ds_buffer_bytes=0," in module.__loader__.get_source(module.__name__)
    q, k, v, w = _inputs(batch, hq, hkv, n_q, n_k, dim, dtype, weight, noncontig)
    scale = 1.0 / math.sqrt(dim) * (0.7 if family == "softmax" else 1.0)
    tol = 1e-4 if dtype == torch.float32 else 2e-2

    o = module.attention(q, k, v, w, scale)
    assert o.dtype == dtype and o.shape == (batch, hq, n_q, dim)
    assert torch.isfinite(o).all(), "unwritten (NaN-poisoned) or non-finite output"
    _assert_matches_float64(family, o, q, k, v, w, scale, causal, tol)


def _count_launches(kernel, monkeypatch):
    """A list that gets one entry per launch of kernel."""
    launched = []
    monkeypatch.setattr(kernel, "run", lambda *a, _run=kernel.run, **kw: launched.append(1) or _run(*a, **kw))
    return launched


DS_CASES = [  # the backward that stores dS and computes dQ = dS K from it: odd sizes both ways, GQA, weights
    ("spherical", True, True, (1, 4, 2, 45, 20, 16), torch.float32, False),
    ("softmax", True, False, (2, 4, 2, 20, 45, 16), torch.float32, True),
    ("sigmoid", False, True, (2, 4, 2, 37, 29, 16), torch.float32, False),
    ("softmax", True, True, (1, 2, 1, 37, 37, 32), torch.bfloat16, False),
]


@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointers"])
@pytest.mark.parametrize("case", DS_CASES, ids=[_case_id(c) for c in DS_CASES])
def test_backward_from_stored_ds_matches_float64_reference(case, tma, tmp_path, monkeypatch):
    """Both ways of moving dS: bulk copies (TMA) and pointer loads and stores (GPUs without TMA)."""
    family, causal, weight, (batch, hq, hkv, n_q, n_k, dim), dtype, noncontig = case
    spec = compiled_kernel_spec(family, causal, weight)
    module = load_attention_module(spec, tmp_path, ds_buffer_bytes=1 << 20, use_tma=tma)
    kernel = module.KERNELS.bwd_dq_ds_kernel  # this op's autotuner of the static kernel
    # query tiles twice the dK/dV kernel's: dS tiles straddling the diagonal then hold entries it never wrote
    monkeypatch.setitem(kernel.configs[0].kwargs, "BLOCK_M", 32)
    launched = _count_launches(kernel, monkeypatch)
    q, k, v, w = _inputs(batch, hq, hkv, n_q, n_k, dim, dtype, weight, noncontig)
    scale = 1.0 / math.sqrt(dim)
    o = module.attention(q, k, v, w, scale)
    _assert_matches_float64(family, o, q, k, v, w, scale, causal, 1e-4 if dtype == torch.float32 else 2e-2)
    assert launched == [1], "the backward did not take the stored-dS path"
    row = -(-n_q // 8) * 8  # the rows of the buffer padded for TMA
    short = load_attention_module(spec, tmp_path, ds_buffer_bytes=batch * hq * n_k * row * q.element_size() - 1,
                                  use_tma=tma)  # one byte short: recompute
    stored = _count_launches(short.KERNELS.bwd_dq_ds_kernel, monkeypatch)
    recomputed = _count_launches(short.KERNELS.bwd_dq_kernel, monkeypatch)
    o = short.attention(q, k, v, w, scale)
    o.backward(torch.randn_like(o))
    assert launched == [1] and stored == [] and recomputed == [1]


def test_backward_recomputes_when_the_ds_buffer_cannot_be_allocated(tmp_path, monkeypatch):
    module = load_attention_module(compiled_kernel_spec("softmax", True, False), tmp_path, ds_buffer_bytes=1 << 20)
    q, k, v, _ = _inputs(1, 2, 1, 21, 19, 16, torch.float32, False, False)
    ds_shape = (2, 19, 24)  # [B * Hq, Nk, Nq rounded up to 8]

    def new(shape, dtype, device, _new=module.KERNELS.new):
        if tuple(shape) == ds_shape:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return _new(shape, dtype, device)

    monkeypatch.setattr(module.KERNELS, "new", new)
    launched = _count_launches(module.KERNELS.bwd_dq_kernel, monkeypatch)
    o = module.attention(q, k, v, None, 0.25)
    _assert_matches_float64("softmax", o, q, k, v, None, 0.25, True, 1e-4)
    assert launched == [1], "the backward did not fall back to the recomputing dQ kernel"


def _assert_matches_float64(family, o, q, k, v, w, scale, causal, tol):
    """o and the gradients it sends to q, k, v (through a fresh random grad_o) within tol of float64."""
    grad_o = torch.randn_like(o)
    o.backward(grad_o)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference(family, q64, k64, v64, None if w is None else w.double(), scale, causal)
    ref.backward(grad_o.double())
    assert rel_err(o.detach(), ref.detach()) < tol
    for name, got, want in (("dq", q.grad, q64.grad), ("dk", k.grad, k64.grad), ("dv", v.grad, v64.grad)):
        assert got.dtype == q.dtype and got.shape == want.shape
        assert torch.isfinite(got).all(), f"{name}: unwritten (NaN-poisoned) or non-finite"
        assert rel_err(got, want) < tol, f"{name}: rel err {rel_err(got, want):.2e}"


def test_stats_and_default_scale(tmp_path):
    module = load_attention_module(softmax_spec(), tmp_path)
    q, k, v, _ = _inputs(1, 2, 2, 19, 23, 16, torch.float32, False, False)
    o, (z, m) = module.forward(q.detach(), k.detach(), v.detach())
    s = (q.detach().double() @ k.detach().double().transpose(-1, -2)) / 4.0
    assert rel_err(m, s.amax(-1)) < 1e-6
    assert rel_err(z, torch.exp(s - s.amax(-1, keepdim=True)).sum(-1)) < 1e-6
    ref = reference("softmax", q.double(), k.double(), v.double(), None, 0.25, False)
    assert rel_err(o, ref) < 1e-4
    _, (z2, m2) = load_attention_module(spherical_spec(), tmp_path).forward(q, k, v)
    assert m2 is None and z2.shape == (1, 2, 19)


def test_rendered_module_is_valid_python_with_origins():
    spec = AttentionKernelSpec(
        name="attn", a1="x", a2="x * x", da1="1.0", da2="2.0 * x", b="tl.sqrt(z)", db_over_b="0.5 / z",
        online_max=False, causal=True, has_weight=True,
        origin=(("a2", "spec.ncd:7"), ("causal", "spec.ncd:9"), ("attention", "spec.ncd:3")),
    )
    text = render_attention_module(spec)
    tree = ast.parse(text)
    # the module holds the spec's device functions only; the kernels are ncd/families/attention/kernel.py's
    functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert functions == {"_a1", "_a2", "_da1", "_da2", "_b", "_db_over_b", "attention"}
    assigned = {t.id for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
    assert {"forward", "backward", "Attention", "CONFIG", "KERNELS"} <= assigned
    imports = {a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names}
    assert imports <= {"math", "torch", "triton", "triton.language"}
    assert {n.module for n in tree.body if isinstance(n, ast.ImportFrom)} == {"ncd.families.attention",
                                                                              "ncd.families.attention.kernel"}
    assert "CAUSAL" not in text and "causal=True,  # spec.ncd:9" in text  # flags enter as constructor arguments
    assert len(text.splitlines()) <= 150
    assert "return x * x  # spec.ncd:7" in text
    assert "# spec.ncd:9" in text and "attention: spec.ncd:3" in text
    assert "tl.full(x.shape, 1.0, tl.float32)" in text  # constant derivative broadcast to the tile
    assert text == render_attention_module(spec)  # deterministic


@pytest.mark.parametrize(
    "field, value",
    [("a1", "y * 2"), ("b", "x + 1"), ("a2", "x *"), ("a1", "x\n+ 1"), ("name", "not an id"),
     ("da1", "__import__('os')")],
)
def test_bad_specs_are_rejected(field, value):
    kwargs = dict(
        name="s", a1="x", a2="x * x", da1="1.0", da2="2.0 * x", b="tl.sqrt(z)", db_over_b="0.5 / z",
        online_max=False, causal=False, has_weight=False,
    )
    kwargs[field] = value
    with pytest.raises(AttentionSpecError):
        AttentionKernelSpec(**kwargs)


@pytest.mark.parametrize("family", ["softmax", "spherical"])
def test_heads_fast_grid_order(family, tmp_path):
    """The HEADS_FAST launch order (batch * heads on the x axis) computes the same thing."""
    module = load_attention_module(compiled_kernel_spec(family, causal=True), tmp_path / "hf")
    for kernel in ("fwd", "bwd_dkdv", "bwd_dq"):
        getattr(module.KERNELS, f"{kernel}_kernel").configs[0].kwargs["HEADS_FAST"] = 1
    q, k, v, _ = _inputs(1, 4, 2, 35, 35, 16, torch.float32, False, False)
    o = module.attention(q, k, v, None, 0.25)
    grad_o = torch.randn_like(o)
    o.backward(grad_o)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference(family, q64, k64, v64, None, 0.25, True)
    ref.backward(grad_o.double())
    for got, want in ((o.detach(), ref.detach()), (q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        assert rel_err(got, want) < 1e-4


# ---------------------------------------------------------------------------------------------
# The factorized (chunked when causal) form: forward_factorized / backward_factorized
# ---------------------------------------------------------------------------------------------

FACTORIZED_CASES = [
    # family, causal, weight, (B, Hq, Hkv, Nq, Nk, D), chunk, dtype
    ("spherical", True, False, (2, 4, 2, 37, 29, 16), 16, torch.float32),
    ("spherical", True, True, (1, 4, 2, 77, 77, 32), 32, torch.float32),
    ("spherical", True, True, (1, 2, 1, 45, 20, 16), 16, torch.float32),  # queries past the last key
    ("spherical", True, False, (1, 2, 2, 20, 45, 16), 32, torch.float32),  # keys past the last query
    ("spherical", False, True, (2, 4, 2, 37, 77, 16), 16, torch.float32),
    ("poly", True, True, (1, 4, 2, 77, 37, 32), 32, torch.float32),
    ("poly", False, True, (2, 2, 1, 37, 29, 16), 16, torch.float32),
    ("linear", True, False, (1, 2, 1, 37, 37, 16), 16, torch.float32),
    ("spherical", False, False, (1, 4, 1, 33, 40, 32), 16, torch.bfloat16),
]


def load_factorized_module(family, causal, weight, cache_dir, **config):
    """The generated module with the factorized form; keyword arguments override fields of its config."""
    front, plan = _front(family, causal, weight)
    assert plan.factorization is not None and plan.factorization.causal == causal
    spec = kernel_spec(family, plan.certificate, plan.roles, plan.maps, front.program, (), True)
    config = dataclasses.replace(spec_config(spec, plan.factorization), **config)
    text = render_attention_module(spec, plan.factorization, config)
    ident = f"kernels_fact_{family}_{hashlib.sha256(text.encode()).hexdigest()[:12]}"
    return import_generated(ident, lambda: text, cache_dir)[0]


def _fact_id(case):
    family, causal, weight, shape, chunk, dtype = case
    return "-".join([family, "causal" if causal else "full", "w" if weight else "now", "x".join(map(str, shape)),
                     f"c{chunk}", str(dtype).removeprefix("torch.")])


@pytest.mark.parametrize("case", FACTORIZED_CASES, ids=[_fact_id(c) for c in FACTORIZED_CASES])
def test_factorized_forward_and_gradients_match_float64_reference(case, tmp_path):
    family, causal, weight, (batch, hq, hkv, n_q, n_k, dim), chunk, dtype = case
    # every output and state buffer starts as NaN (NCD_POISON_OUTPUTS, tests/conftest.py)
    module = load_factorized_module(family, causal, weight, tmp_path, chunk=chunk)
    assert module.KERNELS.chunk == chunk
    q, k, v, w = _inputs(batch, hq, hkv, n_q, n_k, dim, dtype, weight, family == "spherical" and not causal)
    q, k, v = (t.detach() for t in (q, k, v))
    scale = 0.7 / math.sqrt(dim)
    tol = 1e-4 if dtype == torch.float32 else 2e-2

    o, stats = module.forward_factorized(q, k, v, w, scale)
    assert o.dtype == dtype and o.shape == (batch, hq, n_q, dim) and torch.isfinite(o).all()
    _, h, _ = stats
    assert h.shape == (batch * hkv, math.ceil(n_q / chunk) if causal else 1, dim, 2 * dim)
    grad_o = torch.randn_like(o)
    dq, dk, dv = module.backward_factorized(grad_o, q, k, v, o, stats, w, scale)

    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref = reference(family, q64, k64, v64, None if w is None else w.double(), scale, causal)
    ref.backward(grad_o.double())
    assert rel_err(o, ref.detach()) < tol
    for name, got, want in (("dq", dq, q64.grad), ("dk", dk, k64.grad), ("dv", dv, v64.grad)):
        assert got.dtype == dtype and got.shape == want.shape
        assert torch.isfinite(got).all(), f"{name}: unwritten (NaN-poisoned) or non-finite"
        assert rel_err(got, want) < tol, f"{name}: rel err {rel_err(got, want):.2e}"


def test_factorized_module_passes_the_coefficients():
    """The factorized kernels are static (families/attention/kernel_chunked.py); the module passes the coefficients of
    a1, a2 (constexprs there, so the terms of zero coefficients compile away) with their origin."""
    front, plan = _front("spherical", True, True)
    spec = kernel_spec("sph", plan.certificate, plan.roles, plan.maps, front.program, (), True)
    text = render_attention_module(spec, plan.factorization)
    names = {t.id for n in ast.parse(text).body if isinstance(n, (ast.Assign, ast.AnnAssign))
             for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
    assert {"forward_factorized", "backward_factorized", "FactorizedAttention", "CHUNK"} <= names
    assert "FACT_NEED_VEC = False" in text  # c0 = e0 = e1 = 0
    assert "coefficients=(0.0, 1.0, 0.0, 0.0, 1.0),  # spherical.ncd:10" in text  # the normalize line
    assert "factorized=True" in text  # the config says the form is there
    poly_front, poly_plan = _front("poly", False, False)
    poly = render_attention_module(kernel_spec("poly", poly_plan.certificate, poly_plan.roles, poly_plan.maps,
                                               poly_front.program, (), True), poly_plan.factorization)
    assert "FACT_NEED_VEC = True" in poly and "coefficients=(0.5, -2.0, 1.0, 1.0, 3.0)," in poly
    with pytest.raises(AttentionSpecError, match="polynomial"):
        render_attention_module(softmax_spec(), poly_plan.factorization)


@pytest.mark.parametrize("family", ["softmax", "spherical"])
def test_pointer_and_tma_paths_agree(family, tmp_path):
    """The kernels read through TMA descriptors where the layout allows and through pointers otherwise
    (config use_tma=False, or a base address that is not 16-byte aligned); both compute the same thing."""
    spec = compiled_kernel_spec(family, causal=True)
    modules = {use_tma: load_attention_module(spec, tmp_path, use_tma=use_tma) for use_tma in (True, False)}
    q, k, v, _ = _inputs(1, 4, 2, 35, 35, 16, torch.float32, False, False)
    flat = torch.randn(q.numel() + 1)
    shifted = flat[1:].view(q.shape)  # 4 bytes past an aligned allocation
    assert modules[True]._tma_ok(q, k, v) and not modules[True]._tma_ok(shifted, k, v)
    assert not modules[False]._tma_ok(q, k, v)
    results = []
    for use_tma, q_in in ((True, q), (False, q), (True, shifted.copy_(q.detach()).requires_grad_())):
        module = modules[use_tma]
        q_in.grad = k.grad = v.grad = None
        o = module.attention(q_in, k, v, None, 0.25)
        o.backward(torch.ones_like(o))
        results.append([o.detach(), q_in.grad, k.grad, v.grad])
    for other in results[1:]:
        for got, want in zip(other, results[0], strict=True):
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["softmax", "spherical"])
def test_atomic_dq_backward_matches_float64(family, tmp_path):
    """deterministic_bwd=False: one kernel per key block adds its dQ share into an fp32 accumulator with
    atomics; causal, grouped heads, per-key weights, ragged sizes."""
    module = load_attention_module(compiled_kernel_spec(family, causal=True, has_weight=True), tmp_path,
                                   deterministic_bwd=False)
    q, k, v, w = _inputs(2, 4, 2, 37, 45, 16, torch.float32, True, False)
    _assert_matches_float64(family, module.attention(q, k, v, w, 0.25), q, k, v, w, 0.25, True, 1e-4)


def test_two_ops_share_the_static_kernels_but_not_their_tuning(tmp_path):
    """Two specs with different maps in one process: the same static kernels, each op with its own autotuners
    (whose key holds the op's maps), and each op computes its own maps, interleaved."""
    from ncd.families.attention import kernel as kernels

    spherical = load_attention_module(compiled_kernel_spec("spherical", causal=True), tmp_path / "a")
    signed = load_attention_module(compiled_kernel_spec("signed_l1", causal=True), tmp_path / "b")
    for name in ("fwd_kernel", "bwd_dkdv_kernel", "bwd_dq_kernel", "bwd_fused_kernel"):
        tuned = [getattr(m.KERNELS, name) for m in (spherical, signed)]
        assert tuned[0] is not tuned[1] and tuned[0].fn is tuned[1].fn is getattr(kernels, name)
        assert {"A1", "A2", "B"} <= set(tuned[0].keys)  # the op's maps are in the tuning key
    q, k, v, _ = _inputs(1, 2, 1, 19, 17, 16, torch.float32, False, False)
    for family, module in (("spherical", spherical), ("signed_l1", signed)):
        q.grad = k.grad = v.grad = None
        _assert_matches_float64(family, module.attention(q, k, v, None, 0.3), q, k, v, None, 0.3, True, 1e-4)


def test_rendered_module_is_ruff_clean_and_imports_what_it_uses():
    """Maps that need no `tl` (and a spec's long maps, whose origin moves to the comment line) still lint clean."""
    from ncd.lint import lint_generated

    plain = AttentionKernelSpec(name="sq", a1="x * x", a2="(x * x)", da1="2.0 * x", da2="2.0 * x", b="z",
                                db_over_b="1.0 / z", online_max=False, causal=False, has_weight=False,
                                origin=(("a1", "sq.ncd:4"),))
    text = render_attention_module(plain)
    assert "import triton.language as tl" not in text and "return x * x  # sq.ncd:4" in text
    assert lint_generated(text, "sq") == []
    long_map = "tl.where((x) <= 0, tl.exp(-tl.abs(x))/(tl.exp(-tl.abs(x)) + 1.0), (1.0 / ((tl.exp(-tl.abs(x)) + 1.0))))"
    sig = dataclasses.replace(plain, name="sig", a1=long_map, a2=long_map, origin=(("a1", "sig.ncd:14"),))
    text = render_attention_module(sig)
    assert "# a1: numerator map; sig.ncd:14" in text and lint_generated(text, "sig") == []


def test_kernels_refuse_an_incomplete_set_of_maps(tmp_path):
    from ncd.families.attention.kernel import AttentionConfig, AttentionKernels

    maps = dict(load_attention_module(spherical_spec(), tmp_path).MAPS)
    with pytest.raises(ValueError, match=r"missing \['B'\]"):
        AttentionKernels("x", AttentionConfig(), {k: v for k, v in maps.items() if k != "B"}, {}, causal=False,
                         has_weight=False)
    with pytest.raises(ValueError, match="PRE and DPRE come together"):
        AttentionKernels("x", AttentionConfig(), {**maps, "PRE": maps["A1"]}, {}, causal=False, has_weight=False)
