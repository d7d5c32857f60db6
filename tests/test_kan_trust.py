"""Issue 30, the group-rational (KAT) and polynomial-KAN modules: NaN in -> NaN out exactly where the math says
so (both basis evaluations, the GEMM regime, the rational kernels, max/min in a spec), shape errors instead of
silent reshapes, a degree of 1000 compiling in bounded time, picklable modules with contiguous parameters, and
KATGroup with KAT_Group's signature, init modes, coefficients and default.

References are float64 eager PyTorch written here; NaN masks are compared exactly, finite values to 1e-4."""

from __future__ import annotations

import copy
import io
import pickle
import time

import pytest
import torch

import ncd
from ncd.errors import CallError
from ncd.families.polykan.basis_lut import MAX_TABLE_CELLS, Recurrence, choose_table
from ncd.families.polykan.plan import SPECS, ChebyKANLayer, PolyKANLayer, basis_op, plan_polykan
from ncd.kan import GroupRational, KATGroup
from ncd.pipeline import front_end

from .conftest import ROOT

KAT_SPEC = ROOT / "specs" / "kat_rational.ncd"

# KAT_Group's init modes, in the order of its init file (kat_rational/init.json of github.com/Adamdad/rational_kat_cu)
KAT_MODES = ("identity", "leaky_relu", "tanh", "sigmoid", "relu", "gelu_old", "gelu", "swish", "geglu", "swishglu",
             "leaky_relu_0.1", "erfc_Softplus_2")
# Published numbers (that file), typed into this test independently of ncd/kat_init.py: (a_0..a_5, b_1..b_4)
KAT_PUBLISHED = {
    "gelu": ((-0.00153969, 0.51692871, 0.44075827, 0.0972553, -0.00884418, -0.00378675),
             (-0.14171056, -0.06481231, -0.0444695, 0.01283776)),
    "geglu": ((0.00079642, -0.00602563, 0.49750578, 0.47691076, 0.15421425, 0.0168486),
              (-0.12619161, -0.20067464, -0.03005465, 0.0027335)),
    "erfc_Softplus_2": ((0.10685354, -0.23290146, 0.19928975, -0.08317628, 0.01685602, -0.0013217),
                        (-0.04596856, 0.4134001, 0.01430384, 0.03504373)),
}


@pytest.fixture(autouse=True)
def _cache(op_cache, monkeypatch):
    monkeypatch.setenv("NCD_CACHE_DIR", str(op_cache))


def _kat_f64(x: torch.Tensor, a, b) -> torch.Tensor:
    """KAT_Group's function (version A): P(x) / (1 + sum_j |b_j| |x|^j), float64."""
    x = x.double()
    p = sum(float(a[i]) * x ** i for i in range(len(a)))
    q = 1 + sum(abs(float(b[j])) * x.abs() ** (j + 1) for j in range(len(b)))
    return p / q


def _same_nan_and_close(got: torch.Tensor, ref: torch.Tensor, name: str, tol: float = 1e-4) -> None:
    got, ref = got.detach().double(), ref.detach().double()
    assert torch.equal(torch.isnan(got), torch.isnan(ref)), (name, torch.isnan(got), torch.isnan(ref))
    assert torch.equal(torch.isinf(got), torch.isinf(ref)), name
    ok = torch.isfinite(ref)
    err = (got[ok] - ref[ok]).norm() / ref[ok].norm().clamp_min(1e-30)
    assert err < tol, (name, float(err))


# --- item 8: NaN inputs -----------------------------------------------------------------------------------------


def _cheby_ref(x: torch.Tensor, c: torch.Tensor, degree: int) -> torch.Tensor:
    u = torch.tanh(x)
    terms = [torch.ones_like(u), u]  # T_0 = 1 is a constant of the recurrence: finite at a NaN argument
    for _ in range(1, degree):
        terms.append(2 * u * terms[-1] - terms[-2])
    return torch.einsum("bid,iod->bo", torch.stack(terms[: degree + 1], -1), c)


@pytest.mark.parametrize("basis_eval,regime", [("lut", None), ("recurrence", None), ("lut", "gemm")])
def test_polykan_nan_in_nan_out_exactly_where_the_math_says(basis_eval, regime):
    """NaN at some inputs: NaN exactly in the output rows, dx entries and dC columns that depend on them (dC for
    T_0 = 1 stays finite), finite elsewhere; +-inf saturate through tanh (finite). The LUT path once clamped the
    argument before its NaN test and returned finite outputs."""
    degree, (b, i, o) = 3, (9, 7, 5)
    op = basis_op("chebyshev", degree, basis_eval)
    torch.manual_seed(1)
    x = torch.randn(b, i, dtype=torch.float64)
    x[1, 2] = x[6, 0] = float("nan")
    x[3, 4], x[4, 1] = float("inf"), -float("inf")
    c = torch.randn(i, o, degree + 1, dtype=torch.float64) / i
    gy = torch.randn(b, o, dtype=torch.float64)
    if regime is not None:
        op = op.with_config(regime=regime)  # the gemm regime at every size
    xf, cf = x.float().requires_grad_(True), c.float().requires_grad_(True)
    y = op(xf, cf)
    dx, dc = torch.autograd.grad(y, [xf, cf], gy.float())
    xd, cd = x.clone().requires_grad_(True), c.clone().requires_grad_(True)
    yr = _cheby_ref(xd, cd, degree)
    dxr, dcr = torch.autograd.grad(yr, [xd, cd], gy)
    assert torch.isnan(yr).any(1).tolist() == [r in (1, 6) for r in range(b)]  # the reference says so
    assert not torch.isnan(dcr[:, :, 0]).any() and torch.isnan(dcr[2, :, 1:]).all()
    _same_nan_and_close(y, yr, "y")
    _same_nan_and_close(dx, dxr, "dx")
    _same_nan_and_close(dc, dcr, "dC")


def _rational_ref(x, a, b):
    """float64 KAT form, group g of channel c = c // width, abs differentiated with sign+(0) = +1."""
    rows, chans = x.shape
    groups = b.shape[0]
    x3 = x.reshape(rows, groups, chans // groups)
    p = sum(a[i] * x3 ** i for i in range(a.shape[0]))
    sign_b = torch.where(b >= 0, 1.0, -1.0).double()
    babs = b * sign_b  # |b| with the +1 convention at 0 (b is nonzero here)
    q = 1 + sum(babs[:, j].view(1, -1, 1) * x3.abs() ** (j + 1) for j in range(b.shape[1]))
    return (p / q).reshape(rows, chans)


def test_rational_nan_and_inf_follow_the_math():
    """KAT's rational: NaN and +-inf inputs give NaN exactly where float64 does (the output and dx entries of those
    elements; the coefficient gradients sum over every element, so they are NaN), finite elsewhere."""
    op = ncd.load(KAT_SPEC)
    torch.manual_seed(2)
    x = torch.randn(7, 24, dtype=torch.float64)  # the spec's 8 groups of width 3
    x[0, 1], x[3, 7], x[5, 10] = float("nan"), float("inf"), -float("inf")
    a = torch.randn(6, dtype=torch.float64)
    b = torch.randn(8, 4, dtype=torch.float64)
    gy = torch.randn(7, 24, dtype=torch.float64)
    xf, af, bf = (t.float().requires_grad_(True) for t in (x, a, b))
    y = op(xf, af, bf)
    dx, da, db = torch.autograd.grad(y, [xf, af, bf], gy.float())
    xd, ad, bd = (t.clone().requires_grad_(True) for t in (x, a, b))
    yr = _rational_ref(xd, ad, bd)
    dxr, dar, dbr = torch.autograd.grad(yr, [xd, ad, bd], gy)
    assert torch.isnan(yr).sum() == 3
    for name, got, ref in (("y", y, yr), ("dx", dx, dxr), ("dA", da, dar), ("dB", db, dbr)):
        _same_nan_and_close(got, ref, name)


RELU_SPEC = """spec relu_mix
axis row
axis group = 2
axis width
axis chan = group * width
axis num = 2
in    x[row chan] : f32
param A[group num] : f32
out y[row chan] = A[group, 0] * max(x, 0) + A[group, 1] * min(x, 0)
"""


def test_max_and_min_in_a_spec_propagate_nan(tmp_path):
    """max(x, 0) and min(x, 0) once dropped a NaN (maximum / minimum without NaN propagation, and a derivative
    where(x > 0, 1, 0) giving 0 at NaN): y, dx and dA were finite for a NaN input."""
    path = tmp_path / "relu_mix.ncd"
    path.write_text(RELU_SPEC, encoding="utf-8")
    op = ncd.load(path)
    torch.manual_seed(3)
    x = torch.randn(5, 6, dtype=torch.float64)
    x[1, 1] = float("nan")  # group 0
    a = torch.randn(2, 2, dtype=torch.float64)
    gy = torch.randn(5, 6, dtype=torch.float64)
    xf, af = x.float().requires_grad_(True), a.float().requires_grad_(True)
    y = op(xf, af)
    dx, da = torch.autograd.grad(y, [xf, af], gy.float())
    xd, ad = x.clone().requires_grad_(True), a.clone().requires_grad_(True)
    x3 = xd.view(5, 2, 3)
    yr = (ad[:, 0].view(1, 2, 1) * x3.clamp_min(0) + ad[:, 1].view(1, 2, 1) * x3.clamp_max(0)).view(5, 6)
    dxr_autograd, dar = torch.autograd.grad(yr, [xd, ad], gy)
    # dy/dx = A0 H(x) + A1 (1 - H(x)) with H(NaN) = NaN (torch's clamp backward gives 0 at NaN: not the math)
    h = torch.where(x > 0, 1.0, torch.where(x <= 0, 0.0, x)).view(5, 2, 3)
    dxr = (gy.view(5, 2, 3) * (a[:, 0].view(1, 2, 1) * h + a[:, 1].view(1, 2, 1) * (1 - h))).view(5, 6)
    ok = ~torch.isnan(x)
    assert torch.allclose(dxr[ok], dxr_autograd[ok]) and torch.isnan(dxr[1, 1])
    assert torch.isnan(dar[0]).all() and not torch.isnan(dar[1]).any()
    for name, got, ref in (("y", y, yr), ("dx", dx, dxr), ("dA", da, dar)):
        _same_nan_and_close(got, ref, name)


# --- item 10: no silent reshape ---------------------------------------------------------------------------------


def test_polykan_layers_reject_a_wrong_input_width():
    """A [4, 6] input for a 4-input layer was reshaped into 6 rows of 4 without a word."""
    for layer in (ChebyKANLayer(4, 3, 2), PolyKANLayer(4, 3, 2, "legendre")):
        with pytest.raises(CallError, match=r"x: axis 'inp' .* has size 6, but this layer has input_dim 4"):
            layer(torch.randn(4, 6))
        with pytest.raises(CallError, match="axis 'inp'"):
            layer(torch.randn(2, 3, 5))
        with pytest.raises(CallError, match="axis 'inp'"):
            layer(torch.tensor(1.0))
        x = torch.randn(2, 3, 4)  # leading dims are flattened into the batch
        assert torch.equal(layer(x), layer(x.reshape(6, 4)))
    with pytest.raises(CallError, match="x must be a tensor"):
        GroupRational(2, 3, 2)(torch.tensor(1.0))


# --- item 12: degree 1000 -----------------------------------------------------------------------------------------


def test_degree_1000_compiles_in_bounded_time():
    """The table search once measured tables of up to 65,536 entries x 1001 degrees (minutes, gigabytes); the
    size cap (MAX_TABLE_CELLS) bounds it, and such degrees take the exact recurrence."""
    start = time.perf_counter()
    front = front_end(SPECS["chebyshev"], "cheby_kan.ncd", sizes={"deg": 1001})
    plan = plan_polykan(front, {})
    elapsed = time.perf_counter() - start
    assert plan is not None and plan.basis_eval == "recurrence" and "size cap" in plan.note
    assert plan.choice is not None and all(n is None for _, n in plan.choice.needed)
    assert elapsed < 30, elapsed
    rec = Recurrence.from_ir(front_end(SPECS["chebyshev"], "x.ncd").program.bases[0])
    small = choose_table(rec, 9, -1.0, 1.0)  # ordinary degrees keep their tables, within the cap
    assert small.table is not None and small.table.entries * 9 <= MAX_TABLE_CELLS


# --- item 16: picklable modules, contiguous parameters, KAT's signature and init ------------------------------------


def _modules():
    return [
        (KATGroup(4, "swish", "cpu"), torch.randn(2, 3, 20)),
        (GroupRational(3, 4, 3, form="paper", shared_numerator=False), torch.randn(5, 9)),
        (ChebyKANLayer(5, 3, 4), torch.randn(2, 3, 5)),
        (PolyKANLayer(5, 3, 2, "hermite", basis_eval="recurrence"), torch.randn(7, 5)),
    ]


def test_modules_deepcopy_pickle_and_torch_save():
    """EMA wrappers deepcopy the model; checkpoints torch.save it whole: both failed on the generated module."""
    for module, x in _modules():
        with torch.no_grad():
            for p in module.parameters():
                p.add_(0.01 * torch.randn_like(p))
        y = module(x)
        buffer = io.BytesIO()
        torch.save(module, buffer)
        buffer.seek(0)
        copies = [copy.deepcopy(module), pickle.loads(pickle.dumps(module)), torch.load(buffer, weights_only=False)]
        for other in copies:
            assert type(other) is type(module)
            assert torch.equal(other(x), y), type(module).__name__
            for p, q in zip(module.parameters(), other.parameters(), strict=True):
                assert p is not q and torch.equal(p, q) and p.stride() == q.stride()
        ema = copies[0]  # an EMA copy trains on its own
        ema(x).square().sum().backward()
        assert all(p.grad is not None for p in ema.parameters()) and all(p.grad is None for p in module.parameters())
        assert all(p.is_contiguous() for p in module.parameters()), type(module).__name__
        vector = torch.nn.utils.parameters_to_vector(module.parameters())
        assert vector.numel() == sum(p.numel() for p in module.parameters())


def test_kat_group_has_kat_signature_modes_and_default():
    """KAT_Group(num_groups=8, mode="gelu", device="cuda"): the positional device was taken as `accumulate`; 3 of
    KAT's modes were offered, "gelu" was a different function and the default was "swish"."""
    default = KATGroup()
    assert default.mode == "gelu" and default.num_groups == 8
    positional = KATGroup(8, "gelu", "cuda")  # KAT's positional order; the kernels run on the input's device
    assert positional.mode == "gelu" and positional.accumulate is None
    x = torch.linspace(-3, 3, 2 * 3 * 16).reshape(2, 3, 16)
    with torch.no_grad():
        y = positional(x)
    a, b = KAT_PUBLISHED["gelu"]
    assert float((y.double() - _kat_f64(x, a, b)).abs().max()) < 1e-5
    assert KATGroup(8, "gelu", torch.device("cpu")).device_kind == "cpu"
    for bad in ("tpu", "atomic", "cuda:0", None):
        with pytest.raises(ValueError, match="device must be one of"):
            KATGroup(8, "gelu", bad)
    for bad_mode in ("GELU", "softplus", ""):
        with pytest.raises(ValueError, match="mode must be one of KAT's init modes"):
            KATGroup(8, bad_mode)
    with pytest.raises(TypeError):
        KATGroup(8, "gelu", "cpu", "atomic")  # the extras are keyword-only


def test_kat_group_every_mode_is_kat_init():
    """Every KAT mode: the parameters are KAT's numbers (fp32, as KAT_Group stores them: numerator [1, 6], the
    denominator repeated per group) and the module computes KAT's function on a grid."""
    from ncd.kat_init import KAT_INIT

    assert tuple(KAT_INIT) == KAT_MODES
    for mode, (a, b) in KAT_PUBLISHED.items():
        assert KAT_INIT[mode] == (a, b), mode
    x = torch.linspace(-3, 3, 3 * 15).reshape(3, 15)
    for mode in KAT_MODES:
        module = KATGroup(3, mode, "cpu")
        a, b = KAT_INIT[mode]
        assert torch.equal(module.weight_numerator, torch.tensor(a).view(1, 6).float()), mode
        assert torch.equal(module.weight_denominator, torch.tensor(b).float().repeat(3, 1)), mode
        with torch.no_grad():
            y = module(x)
        ref = _kat_f64(x, torch.tensor(a).float(), torch.tensor(b).float())  # what KAT's fp32 parameters give
        assert float((y.double() - ref).abs().max() / ref.abs().max().clamp_min(1.0)) < 1e-5, mode


def test_contiguous_default_layout_matches_the_kernel_layout():
    """The default layout is contiguous (ChebyKAN's); its calls after the first skip the checks (a recorded route)
    and copy to the kernel layout inside one autograd function: same bits as the kernel-layout parameter."""
    spec_layer, kernel_layer = ChebyKANLayer(7, 5, 3), ChebyKANLayer(7, 5, 3, layout="kernel")
    kernel_layer.load_state_dict(spec_layer.state_dict())
    assert spec_layer.cheby_coeffs.is_contiguous() and not kernel_layer.cheby_coeffs.is_contiguous()
    x = torch.randn(9, 7)
    for _ in range(2):  # the first call records the route, the second takes it
        outs = []
        for layer in (spec_layer, kernel_layer):
            layer.zero_grad(set_to_none=True)
            xr = x.clone().requires_grad_(True)
            y = layer(xr)
            y.backward(torch.ones_like(y))
            with torch.no_grad():
                outs.append((y.detach(), xr.grad, layer.cheby_coeffs.grad, layer(x)))
        for a, b in zip(*outs, strict=True):
            assert torch.equal(a, b)
        assert spec_layer.cheby_coeffs.grad.stride() == spec_layer.cheby_coeffs.stride()


def test_the_kan_layers_import_from_ncd_kan_as_the_readme_says():
    """README: `ncd.kan.KATGroup`, `ncd.kan.ChebyKANLayer`, `ncd.kan.PolyKANLayer` (a package move once dropped
    the last two)."""
    import ncd.kan

    assert ncd.kan.ChebyKANLayer is ChebyKANLayer and ncd.kan.PolyKANLayer is PolyKANLayer
    assert issubclass(ncd.kan.KATGroup, torch.nn.Module)
