"""The group-rational family (KAT / FlashKAT) on the CPU, through Triton's interpreter.

Every comparison is against float64: an independent hand-written PyTorch formula with autograd (abs
differentiated with ncd's convention sign+(0) = +1) and the float64 reference evaluation of the spec's IR.
Fresh random inputs at odd sizes; outputs poisoned with NaN (NCD_POISON_OUTPUTS, tests/conftest.py).

Tolerances: ||out - ref|| / ||ref|| < 1e-4 for every quantity. The coefficient gradients are long sums (a few
thousand terms per group here); fp32 accumulation in registers, then a tree over the tile and at most a few
hundred atomics / partials, keeps their relative error near 1e-7 * sqrt(terms), far below 1e-4.
"""

from __future__ import annotations

import ast

import numpy as np
import pytest
import torch

import ncd
import ncd.reference
from ncd.backend import find_plan
from ncd.errors import CallError, NcdError
from ncd.families.rational.plan import plan_rational
from ncd.family import Decline
from ncd.kan import PRESETS, GroupRational, KATGroup, compile_activation, spec_text
from ncd.launch import _key_of
from ncd.pipeline import front_end
from ncd.validate import validate

from .conftest import ROOT, raise_float_errors

TOL = 1e-4
KAT_SPEC = ROOT / "specs" / "kat_rational.ncd"
PAPER_SPEC = ROOT / "specs" / "group_rational.ncd"


class _AbsPlus(torch.autograd.Function):
    """|u| with d|u|/du = +1 at u = 0 (ncd's convention, the KAT reference kernels')."""

    @staticmethod
    def forward(ctx, u):
        ctx.save_for_backward(u)
        return u.abs()

    @staticmethod
    def backward(ctx, g):
        (u,) = ctx.saved_tensors
        return g * torch.where(u >= 0, 1.0, -1.0).to(g.dtype)


def reference(x, a, b, form, groups):
    """float64 F(x) per group: a [m+1] (shared) or [G, m+1]; b [G, n]."""
    rows, chans = x.shape
    x3 = x.reshape(rows, groups, chans // groups)
    a2 = a.reshape(1, -1) if a.dim() == 1 else a
    p = sum(a2[:, i].view(1, -1, 1) * x3 ** i for i in range(a2.shape[1]))
    n = b.shape[1]
    if form == "kat":
        q = 1 + sum(_AbsPlus.apply(b[:, j]).view(1, -1, 1) * _AbsPlus.apply(x3) ** (j + 1) for j in range(n))
    else:
        q = 1 + _AbsPlus.apply(sum(b[:, j].view(1, -1, 1) * x3 ** (j + 1) for j in range(n)))
    return (p / q).reshape(rows, chans)


def rel(value, ref):
    value, ref = value.detach().double(), ref.detach().double()
    assert not torch.isnan(value).any()
    return float((value - ref).norm() / ref.norm().clamp_min(1e-300))


def check_against_reference(module, x, a, b, form, accumulate=None):
    """Forward and dx, dA, dB of `module.op` against the float64 formula; returns the gradients."""
    xs, as_, bs = (t.detach().clone().requires_grad_() for t in (x, a, b))
    y = module.op(xs, as_, bs, accumulate=accumulate)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, (xs, as_, bs), dy)
    xr, ar, br = (t.detach().double().requires_grad_() for t in (x, a, b))
    yr = reference(xr, ar, br, form, module.num_groups)
    refs = torch.autograd.grad(yr, (xr, ar, br), dy.double())
    assert rel(y, yr) < TOL
    for name, g, r in zip(("dx", "dA", "dB"), grads, refs, strict=True):
        assert rel(g, r) < TOL, name
    return grads


@pytest.mark.parametrize("spec", [KAT_SPEC, PAPER_SPEC], ids=["kat", "paper"])
def test_validate_rows_pass(spec, op_cache):
    op = ncd.load(spec, op_cache)
    with raise_float_errors():
        rows = validate(op)
    assert [r.quantity for r in rows] == ["y", "dx", "dA", "dB"]
    assert all(r.ok for r in rows), rows


@pytest.mark.parametrize("form", ["kat", "paper"])
@pytest.mark.parametrize(("groups", "m", "n", "shape", "shared"), [
    (8, 5, 4, (3, 37, 40), True),
    (4, 3, 2, (3, 37, 36), False),
])
def test_odd_shapes_against_float64(form, groups, m, n, shape, shared, op_cache):
    module = GroupRational(groups, m, n, form=form, shared_numerator=shared, cache_dir=op_cache)
    x = torch.randn(shape).reshape(-1, shape[-1])
    a = torch.randn(m + 1) if shared else torch.randn(groups, m + 1)
    b = torch.randn(groups, n)
    check_against_reference(module, x, a, b, form)


@pytest.mark.parametrize("form", ["kat", "paper"])
def test_zeros_in_x_and_b_use_sign_plus(form, op_cache, monkeypatch):
    """Exact zeros: identity init (b = 0) must still move b, as in the KAT reference kernels (sign(0) = +1)."""
    groups = 4
    module = GroupRational(groups, 5, 4, form=form, cache_dir=op_cache)
    x = torch.randn(45, 36)
    x[::3] = 0.0
    x[:, 5] = 0.0
    a = torch.randn(6)
    b = torch.randn(groups, 4)
    b[0] = 0.0
    b[2, 1] = 0.0
    grads = check_against_reference(module, x, a, b, form)
    assert grads[2][0].abs().min() > 0  # autograd's abs would give exactly 0 here
    # the float64 reference of the spec's IR agrees once its abs takes the same convention
    monkeypatch.setitem(ncd.reference._UNARY, "abs", _AbsPlus.apply)
    leaves = {"x": x.double().requires_grad_(), "A": a.double().requires_grad_(), "B": b.double().requires_grad_()}
    y_ir = ncd.reference.evaluate(module.op.front.program, leaves)["y"]
    dy = torch.randn_like(y_ir)
    ir_grads = torch.autograd.grad(y_ir, list(leaves.values()), dy)
    xs, as_, bs = (t.detach().float().requires_grad_() for t in leaves.values())
    ours = torch.autograd.grad(module.op(xs, as_, bs), (xs, as_, bs), dy.float())
    for g, r in zip(ours, ir_grads, strict=True):
        assert rel(g, r) < TOL


def test_deterministic_mode_is_reproducible_and_agrees(op_cache):
    module = GroupRational(8, 5, 4, form="kat", cache_dir=op_cache)
    x, a, b = torch.randn(77, 40), torch.randn(6), torch.randn(8, 4)
    first = check_against_reference(module, x, a, b, "kat", accumulate="deterministic")
    xs, as_, bs = (t.clone().requires_grad_() for t in (x, a, b))
    y = module.op(xs, as_, bs, accumulate="deterministic")
    dy = torch.randn_like(y)
    g1 = torch.autograd.grad(y, (as_, bs), dy, retain_graph=True)
    g2 = torch.autograd.grad(y, (as_, bs), dy)
    assert all(torch.equal(p, q) for p, q in zip(g1, g2, strict=True))
    assert first[1].shape == (6,) and first[2].shape == (8, 4)
    with pytest.raises(CallError, match="accumulate"):
        module.op(x, a, b, accumulate="sometimes")


def test_block_accumulation_beats_per_element_atomics():
    """Table 8 of the FlashKAT paper at a reduced shape (X [12, 197, 64], G = 8; X, dO, A, B ~ N(0, 1)):
    per-element atomics add every contribution into one fp32 word, i.e. a sequential fp32 sum; the generated
    kernel accumulates in fp32 registers per tile and adds one partial per program."""
    torch.manual_seed(0)
    groups = 8
    module = GroupRational(groups, 5, 4, form="kat", shared_numerator=False)
    x = torch.randn(12 * 197, 64)
    a, b = torch.randn(groups, 6), torch.randn(groups, 4)
    dy = torch.randn_like(x)
    xs, as_, bs = (t.clone().requires_grad_() for t in (x, a, b))
    ours = torch.autograd.grad(module.op(xs, as_, bs), (as_, bs), dy)
    # float64 truth; per-element contributions in fp32, summed sequentially in fp32 (the atomic-add order)
    ar, br = a.double().requires_grad_(), b.double().requires_grad_()
    exact = torch.autograd.grad(reference(x.double(), ar, br, "kat", groups), (ar, br), dy.double())
    terms = _elementwise_coefficient_terms(x.reshape(-1, groups, 8), a, b, dy.reshape(-1, groups, 8))
    # NumPy's add.accumulate is one running fp32 sum (torch's CPU cumsum accumulates in double)
    seq_a, seq_b = (torch.from_numpy(np.add.accumulate(t.numpy(), axis=1, dtype=np.float32)[:, -1]) for t in terms)
    seq_a, seq_b = seq_a.reshape(groups, 6), seq_b.reshape(groups, 4)
    mae_ours = [float((o.double() - e).abs().mean()) for o, e in zip(ours, exact, strict=True)]
    mae_seq = [float((s.double() - e).abs().mean()) for s, e in zip((seq_a, seq_b), exact, strict=True)]
    print("MAE ours", mae_ours, "sequential", mae_seq)
    assert mae_ours[0] * 5 < mae_seq[0] and mae_ours[1] * 5 < mae_seq[1], (mae_ours, mae_seq)


def _elementwise_coefficient_terms(x3, a, b, dy3):
    """dy * dF/dc per element (fp32, version A), as [coefficient, element] for dA [G*6] and dB [G*4]."""
    xa = x3.abs()
    p = sum(a[:, i].view(1, -1, 1) * x3 ** i for i in range(6))
    q = 1 + sum(b[:, j].abs().view(1, -1, 1) * xa ** (j + 1) for j in range(4))
    ta = torch.stack([dy3 * x3 ** i / q for i in range(6)])  # [6, R, G, W]
    sb = torch.where(b >= 0, 1.0, -1.0)
    tb = torch.stack([-dy3 * sb[:, j].view(1, -1, 1) * xa ** (j + 1) * p / q ** 2 for j in range(4)])
    # -> [G * coefficients, R * W] in row order: the order a 1-D grid of per-element atomics would add them
    ta = ta.permute(2, 0, 1, 3).reshape(a.numel(), -1)
    tb = tb.permute(2, 0, 1, 3).reshape(b.numel(), -1)
    return ta, tb


def test_kat_group_loads_state_dict_and_presets(op_cache):
    kat = KATGroup(num_groups=8, mode="swish", cache_dir=op_cache)
    assert kat.weight_numerator.shape == (1, 6) and kat.weight_denominator.shape == (8, 4)
    state = {"weight_numerator": torch.randn(1, 6), "weight_denominator": torch.randn(8, 4)}
    kat.load_state_dict(state)  # a KAT_Group state_dict, unchanged
    assert torch.equal(kat.weight_numerator.detach(), state["weight_numerator"])
    for mode, fn, tol in (("identity", lambda t: t, 1e-6), ("swish", lambda t: t * torch.sigmoid(t), 2e-3),
                          ("tanh", torch.tanh, 2e-4)):
        m = KATGroup(8, mode=mode, cache_dir=op_cache)
        x = torch.linspace(-3, 3, 2 * 5 * 16).reshape(2, 5, 16)  # [B, L, D]
        with torch.no_grad():
            assert float((m(x) - fn(x)).abs().max()) < tol, mode
        assert m(x[:, 0]).shape == (2, 16)  # [B, D]
    assert PRESETS["swish"][0][1] == pytest.approx(0.5, abs=1e-5) and len(PRESETS["gelu"][1]) == 4
    with pytest.raises(ValueError, match="mode"):
        KATGroup(8, mode="softplus", cache_dir=op_cache)


def test_kat_group_autocast_upcasts_and_trains(op_cache):
    """Default: upcast in registers (bf16 in memory, output bf16); upcast_under_autocast=True: KAT's fp32 copy.
    Both compute the same fp32 values; the default returns them rounded to bf16 (what the next autocast op reads;
    one bf16 step apart at most here, since the CPU interpreter's conversion need not round to nearest)."""
    torch.manual_seed(0)
    x0 = torch.randn(2, 3, 24).to(torch.bfloat16)
    outs, grads = {}, {}
    for upcast in (False, True):
        kat = KATGroup(8, mode="swish", cache_dir=op_cache, upcast_under_autocast=upcast)
        x = x0.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = kat(x)
        assert y.dtype == (torch.float32 if upcast else torch.bfloat16)
        y.float().square().sum().backward()
        assert x.grad is not None and x.grad.dtype == torch.bfloat16
        assert kat.weight_denominator.grad.abs().sum() > 0
        outs[upcast], grads[upcast] = y.detach(), x.grad
    torch.testing.assert_close(outs[False].float(), outs[True], rtol=2.0 ** -7, atol=1e-6)
    ident = KATGroup(8, mode="identity", cache_dir=op_cache)
    x = x0.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ident(x).float().square().sum().backward()
    assert ident.weight_denominator.grad.abs().sum() > 0  # b = 0 at identity init still gets a gradient


def test_call_errors_name_tensor_and_axis(op_cache):
    op = ncd.load(KAT_SPEC, op_cache)
    with pytest.raises(CallError, match=r"x: axis 'chan' \(30\) is not a multiple of group \(8\)"):
        op(torch.randn(5, 30), torch.randn(6), torch.randn(8, 4))
    with pytest.raises(CallError, match=r"B: axis 'group' has size 4, but the spec fixes it at 8"):
        op(torch.randn(5, 32), torch.randn(6), torch.randn(4, 4))
    with pytest.raises(CallError, match=r"x has dtype torch\.int64"):
        op(torch.ones(5, 32, dtype=torch.long), torch.randn(6), torch.randn(8, 4))


def test_plan_shows_accumulation_and_atomics(run_cli):
    code, out, err = run_cli("compile", str(KAT_SPEC), "--emit", "plan", "--bind", "row=1000")
    assert code == 0, err
    assert "mode 'atomic' (default): one tl.atomic_add per coefficient per program" in out
    assert "mode 'deterministic'" in out and "atomics:" in out and "row=1000" in out
    assert "sign+(0) = +1" in out
    code, out, err = run_cli("compile", str(PAPER_SPEC), "--emit", "triton")
    assert code == 0, err
    tree = ast.parse(out)
    assert any(isinstance(n, ast.FunctionDef) and n.name == "group_rational" for n in tree.body)
    assert "# group_rational.ncd:17, group_rational.ncd:18, group_rational.ncd:19" in out
    # the kernels are ncd/families/rational/kernel.py's; the module holds the spec's device functions and its config
    hooks = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert {"fwd_constants", "fwd_element", "bwd_element", "bwd_total"} <= hooks and "tl.atomic_add" not in out
    assert "CONFIG = RationalConfig(" in out and "from ncd.families.rational.plan" not in out


def test_recognition_and_located_errors():
    base = ("spec t\naxis row; axis group = 2; axis width; axis chan = group * width; axis den = 2\n"
            "in x[row chan] : f32\nparam B[group den] : f32\n")
    plan = plan_rational(front_end(base + "out y[row chan] = x / (1 + abs(B[group, 0] * x))\n"), {})
    assert plan is not None and [c.label for c in plan.coefficients] == ["B[group, 0]", "B[group, 1]"]
    assert plan.derivation.bwd_dcoef[1] is None  # B[group, 1] is unused: no accumulator
    # a reduction is not element-wise: not this family (the generic family may claim it)
    reduction = front_end(base + "out y[row] = sum(x * B[group, 0], over chan)\n")
    assert isinstance(plan_rational(reduction, {}), Decline)
    assert find_plan(reduction).family != "rational"
    # recognised, but where() is not supported: a located error
    with pytest.raises(NcdError) as err:
        plan_rational(front_end(base + "out y[row chan] = where(x > 0, x, B[group, 1] * x)\n", "w.ncd"), {})
    assert err.value.code == "unsupported" and err.value.span.line == 5
    # the attention specs stay with the attention family
    assert isinstance(plan_rational(ncd.load_spec(ROOT / "specs" / "softmax_attention.ncd"), {}), Decline)


def test_spec_text_matches_shipped_structure():
    text = spec_text(8, 5, 4, "paper", shared_numerator=False)
    front = front_end(text)
    plan = plan_rational(front, {})
    assert plan is not None and plan.k_group == 10 and plan.k_shared == 0
    assert compile_activation(text).front.program.name == "group_rational_paper_m5_n4_g8"


def test_two_ops_share_the_static_kernels_not_their_tuning(op_cache):
    """Two ops with different coefficient counts in one process: each binds ncd/families/rational/kernel.py's kernels to
    its own hooks and autotuners, and interleaved calls stay exact; the plan's config is the module's literal."""
    small = GroupRational(4, 3, 2, form="kat", cache_dir=op_cache)
    large = GroupRational(4, 5, 4, form="paper", shared_numerator=False, cache_dir=op_cache)
    mods = [m.op.module for m in (small, large)]
    assert [m.K for m in mods] == [6, 10] and mods[0]._KERNELS.fwd is not mods[1]._KERNELS.fwd
    assert mods[0]._KERNELS.bwd is not mods[1]._KERNELS.bwd
    assert mods[0]._KERNELS.fwd.fn is mods[1]._KERNELS.fwd.fn  # one static kernel
    # the parameters travel as a tuple: the direct launcher keys it member by member (GPU fast path)
    params = (torch.zeros(4), torch.zeros(2, 3, dtype=torch.float16))
    assert _key_of(params) == (tuple, (_key_of(params[0]), _key_of(params[1])))
    assert _key_of((params[0], object())) is NotImplemented
    for module in (small, large):
        plan = find_plan(module.op.front)
        assert plan.config == module.op.module.CONFIG and plan.config.describe()[0].startswith("config: K = ")
    for _ in range(2):
        for module, shared, (m, n) in ((small, True, (3, 2)), (large, False, (5, 4))):
            x = torch.randn(29, 36)
            a = torch.randn(m + 1) if shared else torch.randn(4, m + 1)
            check_against_reference(module, x, a, torch.randn(4, n), "kat" if shared else "paper",
                                    accumulate="deterministic" if module is large else None)
