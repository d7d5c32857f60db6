"""Issue 32: a value head dim DV different from the query/key head dim D (MLA-style attention, d_qk 192, d_v 128).

The kernels tile q, k, dQ, dK at HEAD_DIM (D rounded up) and v, o, dO, dV at HEAD_DIM_V (DV rounded up). On the CPU
interpreter, at odd sizes (D 40 with DV 24 and D 24 with DV 72, 37 queries over 29 keys), outputs NaN-poisoned
(conftest): the op's output and dQ, dK, dV (and the per-key weight's dM) against float64 references written here
from the formulas, for softmax (running max), spherical (plain sums, with a per-key weight and grouped heads) and a
sliding window (a mask hook: HAS_MASK), through every backward form: the stored-dS one, the recompute one, the fused
one (atomic dQ) and without TMA descriptors."""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass

import pytest
import torch

import ncd
from ncd.errors import CallError
from ncd.families.attention.plan import AttentionPlan

from .conftest import ROOT, raise_float_errors

TOL = 1e-5  # relative (Frobenius) error of fp32 against float64; the kernels measure ~2e-7 here

GQA_SOFTMAX = """spec gqa_value_dim_softmax
axis batch, query, key, kvhead, qgroup
axis head = kvhead * qgroup
axis dim, vdim
in  Q[batch head query dim]   : f32
in  K[batch kvhead key dim]   : f32
in  V[batch kvhead key vdim]  : f32
in  scale : f32 = 1 / sqrt(size(dim))
S[batch head query key] = scale * (Q . K over dim)
A[batch head query key] = normalize(S, over key, a1(x) = exp(x), a2(x) = exp(x), b(z) = z, mask = key <= query)
out O[batch head query vdim] = A . V over key
"""

WEIGHTED_SPHERICAL = """spec value_dim_spherical
axis batch, query, key, kvhead, qgroup
axis head = kvhead * qgroup
axis dim, vdim
in  Q[batch head query dim]   : f32
in  K[batch kvhead key dim]   : f32
in  V[batch kvhead key vdim]  : f32
in  M[batch key]              : f32
S[batch head query key] = Q . K over dim
A[batch head query key] = normalize(S, over key, a1(x) = x, a2(x) = x^2, b(z) = sqrt(z), weight = M)
out O[batch head query vdim] = A . V over key
"""

WINDOW_SOFTMAX = """spec value_dim_window_softmax
axis batch, head, query, key
axis dim, vdim
in  Q[batch head query dim]   : f32
in  K[batch head key dim]     : f32
in  V[batch head key vdim]    : f32
in  window : i32 = 5
in  scale : f32 = 1 / sqrt(size(dim))
S[batch head query key] = scale * (Q . K over dim)
A[batch head query key] = normalize(S, over key, a1(x) = exp(x), a2(x) = exp(x), b(z) = z,
                                    mask = key <= query and key > query - window)
out O[batch head query vdim] = A . V over key
"""

SOURCES = {"gqa_value_dim_softmax": GQA_SOFTMAX, "value_dim_spherical": WEIGHTED_SPHERICAL,
           "value_dim_window_softmax": WINDOW_SOFTMAX}

# the backward's forms (AttentionConfig): stored dS, recompute, fused with atomic dQ; plain pointers instead of TMA
FORMS = {"ds": {}, "recompute": {"ds_buffer_bytes": 0}, "fused": {"deterministic_bwd": False},
         "no-tma": {"use_tma": False, "deterministic_bwd": False}}


@dataclass(frozen=True)
class Case:
    stem: str  # a shipped spec, or one of SOURCES
    d: int
    dv: int
    groups: tuple[int, int] = (3, 1)  # (kv heads, query heads per kv head)
    nq: int = 37
    nk: int = 29

    @property
    def id(self) -> str:
        return f"{self.stem}-D{self.d}-DV{self.dv}-g{self.groups[1]}"


CASES = [
    Case("mla_style_softmax", 40, 24),  # the shipped spec, its sizes overridden
    Case("gqa_value_dim_softmax", 24, 72, (2, 2)),
    Case("value_dim_spherical", 40, 24, (1, 3)),
    Case("value_dim_window_softmax", 24, 72, nq=29),
]


def _load(case: Case, cache, tmp_path_factory) -> ncd.ops.Op:
    if case.stem in SOURCES:
        path = tmp_path_factory.mktemp("specs") / f"{case.stem}.ncd"
        path.write_text(SOURCES[case.stem])
    else:
        path = ROOT / "specs" / f"{case.stem}.ncd"
    sizes = {"dim": case.d, "vdim": case.dv} if case.stem == "mla_style_softmax" else None
    op = ncd.load(path, cache_dir=cache, sizes=sizes)
    assert isinstance(op.plan, AttentionPlan), f"{case.stem} is not compiled by the attention kernels"
    return op


def _draw(case: Case) -> dict:
    g = torch.Generator().manual_seed(zlib.crc32(case.id.encode()))
    batch, (kv_heads, group) = 2, case.groups
    x = {"Q": torch.randn(batch, kv_heads * group, case.nq, case.d, generator=g),
         "K": torch.randn(batch, kv_heads, case.nk, case.d, generator=g),
         "V": torch.randn(batch, kv_heads, case.nk, case.dv, generator=g),
         "dO": torch.randn(batch, kv_heads * group, case.nq, case.dv, generator=g)}
    if case.stem == "value_dim_spherical":
        x["M"] = 0.5 + torch.rand(batch, case.nk, generator=g)  # multiplicities
    return x


def _reference(case: Case, x: dict) -> tuple[torch.Tensor, dict]:
    """float64 output and gradients from the formulas: s = scale q k^T over D, o = sum_j p_ij v_j over DV."""
    leaves = {n: t.double().requires_grad_() for n, t in x.items() if n != "dO"}
    q, k, v = leaves["Q"], leaves["K"], leaves["V"]
    group = case.groups[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # query head h reads kv head h // group
    i, j = torch.arange(case.nq)[:, None], torch.arange(case.nk)[None, :]
    if case.stem == "value_dim_spherical":  # a1 = s, a2 = s^2, b = sqrt(z), weights M; no scale, no mask
        s = q @ k.transpose(-1, -2)
        w = leaves["M"][:, None, None, :]
        o = (w * s) @ v / torch.sqrt((w * s**2).sum(-1, keepdim=True))
    else:
        s = case.d**-0.5 * q @ k.transpose(-1, -2)
        visible = j <= i
        if case.stem == "value_dim_window_softmax":
            visible = visible & (j > i - 5)
        o = torch.softmax(s.masked_fill(~visible, -torch.inf), -1) @ v
    grads = torch.autograd.grad(o, list(leaves.values()), x["dO"].double())
    return o.detach(), {f"d{n}": g for n, g in zip(leaves, grads, strict=True)}


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.detach().double() - want).norm() / want.norm())


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_forward_and_gradients_match_float64(case, form, op_cache, tmp_path_factory):
    op = _load(case, op_cache, tmp_path_factory).with_config(**FORMS[form])
    x = _draw(case)
    leaves = {n: t.clone().requires_grad_() for n, t in x.items() if n != "dO"}
    with raise_float_errors():
        out = op(*leaves.values())
        grads = torch.autograd.grad(out, list(leaves.values()), x["dO"])
    ref, ref_grads = _reference(case, x)
    assert out.shape == ref.shape == (*x["Q"].shape[:3], case.dv)
    assert torch.isfinite(out).all() and _error(out, ref) < TOL, ("O", _error(out, ref))
    for (name, want), got in zip(ref_grads.items(), grads, strict=True):
        assert got.shape == want.shape and torch.isfinite(got).all(), name  # NaN-poisoned: every element written
        assert _error(got, want) < TOL, (name, _error(got, want))


def test_plan_takes_the_value_width_and_streams(run_cli, tmp_path):
    """The plan names V's and O's own width; the factorized form (whose states are [D, 2D]) is not offered to a spec
    it would otherwise take (spherical) when V is narrower."""
    code, out, err = run_cli("compile", str(ROOT / "specs" / "mla_style_softmax.ncd"), "--emit", "plan")
    assert code == 0, err
    assert "V = V[batch head key vdim]  -> O[batch head query vdim]" in out and "vdim=128" in out, out
    path = tmp_path / "value_dim_spherical.ncd"
    path.write_text(WEIGHTED_SPHERICAL)
    op = ncd.load(path, cache_dir=tmp_path)
    assert op.plan.factorization is None and not op.config.factorized
    same = WEIGHTED_SPHERICAL.replace("vdim]", "dim]").replace("axis dim, vdim", "axis dim")
    path.write_text(same)
    assert ncd.load(path, cache_dir=tmp_path).plan.factorization is not None  # the same spec with V over dim


def test_factorized_kernels_refuse_a_value_width_of_their_own(op_cache):
    kernels = ncd.load(ROOT / "specs" / "spherical_attention.ncd", cache_dir=op_cache).module.KERNELS
    q, k = torch.randn(1, 1, 5, 16), torch.randn(1, 1, 7, 16)
    with pytest.raises(ValueError, match="factorized form needs V as wide as Q and K"):
        kernels.forward_factorized(q, k, torch.randn(1, 1, 7, 32))


@pytest.mark.parametrize(("tensor", "shape", "axis"), [("V", (1, 2, 7, 32), "vdim"), ("V", (1, 2, 6, 24), "key"),
                                                       ("K", (1, 2, 7, 24), "dim")])
def test_call_time_errors_name_the_tensor_and_axis(op_cache, tensor, shape, axis):
    op = ncd.load(ROOT / "specs" / "mla_style_softmax.ncd", cache_dir=op_cache, sizes={"dim": 40, "vdim": 24})
    x = {"Q": torch.randn(1, 2, 5, 40), "K": torch.randn(1, 2, 7, 40), "V": torch.randn(1, 2, 7, 24)}
    x[tensor] = torch.randn(shape)
    with pytest.raises(CallError) as info:
        op(*x.values())
    assert info.value.message.startswith(f"{tensor}:") and f"'{axis}'" in info.value.message, info.value.message


def test_cli_check_passes_with_a_value_width_of_its_own(run_cli, tmp_path):
    """`ncd check` of the shipped spec at small fixed widths (at 192 and 128 it takes a minute on the interpreter;
    tests/test_attention_ops.py validates it there in fp32)."""
    source = (ROOT / "specs" / "mla_style_softmax.ncd").read_text()
    path = tmp_path / "mla_style_softmax.ncd"
    path.write_text(source.replace("axis dim = 192", "axis dim = 40").replace("axis vdim = 128", "axis vdim = 24"))
    assert path.read_text() != source
    code, out, err = run_cli("check", str(path))
    assert code == 0, out + err
    assert re.search(r"numerics   (\d+) of \1 cases passed", out), out


def test_torch_compile_fullgraph_sees_the_value_width(op_cache):
    """The custom ops' fakes give O V's width and dV V's shape: torch.compile(fullgraph=True) (aot_eager) matches the
    eager op, forward and gradients."""
    op = ncd.load(ROOT / "specs" / "mla_style_softmax.ncd", cache_dir=op_cache, sizes={"dim": 24, "vdim": 40})
    q, k, v = (torch.randn(1, 2, n, d, requires_grad=True) for n, d in ((19, 24), (23, 24), (23, 40)))
    eager = op(q, k, v)
    grads = torch.autograd.grad(eager.sum(), (q, k, v))
    compiled = torch.compile(op.fn, fullgraph=True, backend="aot_eager")
    out = compiled(q, k, v)
    assert out.shape == (1, 2, 19, 40)
    torch.testing.assert_close(out, eager)
    for got, want in zip(torch.autograd.grad(out.sum(), (q, k, v)), grads, strict=True):
        torch.testing.assert_close(got, want)
