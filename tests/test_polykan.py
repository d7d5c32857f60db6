"""The polynomial-KAN family on the CPU, through Triton's interpreter.

References are float64 eager PyTorch written here from the textbook recurrences (independent of the spec's IR
and of ncd's reference evaluator), with autograd. Fresh random inputs at odd sizes; outputs and split-K partial
buffers poisoned with NaN (NCD_POISON_OUTPUTS, tests/conftest.py). Errors are ||out - ref|| / ||ref||.

Tolerances: 1e-4 for every quantity. The tables are sized for a basis max relative error of 2.5e-5 (values
and derivatives, normalised by max |P_d|); the norm-wise errors measured here are 1e-5 .. 3e-5. The exact
recurrence mode is near fp32 rounding (1e-7 .. 2e-6).
"""

from __future__ import annotations

import ast

import numpy as np
import pytest
import torch

import ncd
from ncd.backend import FallbackWarning, find_plan, op_id, select
from ncd.errors import NcdError, SizeMismatch, UnknownAxis
from ncd.families.polykan.basis_lut import Recurrence, choose_table
from ncd.families.polykan.plan import (
    SPEC_FILES,
    SPECS,
    ChebyKANLayer,
    PolyKANLayer,
    UnsupportedPolyKAN,
    plan_polykan,
    spec_path,
)
from ncd.pipeline import front_end, load_spec
from ncd.validate import validate

from .conftest import ROOT, raise_float_errors

TOL = 1e-4
BASES = ("chebyshev", "legendre", "hermite")


def basis_ref(u: torch.Tensor, degree: int, basis: str) -> torch.Tensor:
    terms = [torch.ones_like(u), 2 * u if basis == "hermite" else u]
    for n in range(1, degree):
        if basis == "chebyshev":
            terms.append(2 * u * terms[-1] - terms[-2])
        elif basis == "legendre":
            terms.append(((2 * n + 1) * u * terms[-1] - n * terms[-2]) / (n + 1))
        else:
            terms.append(2 * u * terms[-1] - 2 * n * terms[-2])
    return torch.stack(terms[: degree + 1], dim=-1)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    assert not torch.isnan(a).any()
    return float((a - b).norm() / b.norm())


@pytest.fixture(autouse=True)
def _cache(op_cache, monkeypatch):
    monkeypatch.setenv("NCD_CACHE_DIR", str(op_cache))


def _in_regime(op, regime):
    """The op compiled with the fused or the gemm regime at every size (its config's `regime`); None: as it is."""
    return op if regime is None else op.with_config(regime=regime)


def _check_layer(basis: str, degree: int, basis_eval: str, sizes=(23, 37, 19), scale: float = 1.5,
                 regime: str | None = None, matmul: str = "tf32x3", tol: float = TOL) -> None:
    b, i, o = sizes
    if matmul == "tf32x3":
        op = ncd.families.polykan.plan.basis_op(basis, degree, basis_eval)
    else:
        op = ncd.load(spec_path(basis), sizes={"deg": degree + 1}, options={"basis_eval": basis_eval, "matmul": matmul})
    x = (torch.randn(b, i, dtype=torch.float64) * scale)
    c = torch.randn(i, o, degree + 1, dtype=torch.float64) / (i * (degree + 1)) ** 0.5
    op = _in_regime(op, regime)
    module = op.module
    # the coefficients stored in the kernel layout [deg, in, out] behind the spec-shaped view (direct path)
    xf, cf = x.float().requires_grad_(True), c.float().permute(2, 0, 1).contiguous().permute(1, 2, 0)
    cf.requires_grad_(True)
    y = op(xf, cf)
    gy = torch.randn_like(y)
    dx, dc = torch.autograd.grad(y, [xf, cf], gy)
    assert dc.stride() == cf.stride()
    # this call's plans (the op is shared: earlier tests in the process leave plans of other sizes beside them)
    plans = [p for key, p in module._PLANS.items() if key[:3] == (b, i, o)]
    assert plans and all(p.til.regime == (regime or "fused") for p in plans)
    if regime != "gemm":  # the test sizes take every two-stage path: split forward, dX and dC partials
        til = plans[0].til
        assert til.fwd_split > 1 and til.bwd_tiles_o > 1 and til.bwd_chunks > 1, til
    # every counter was reset by the program that combined its tile
    assert all(int(cnt.abs().sum()) == 0 for _, cnt in module._BUFFERS.values())
    # deterministic: the same call again gives the same bits
    y2 = op(xf, cf)
    assert torch.equal(y, y2)
    xd, cd = x.clone().requires_grad_(True), c.clone().requires_grad_(True)
    yr = torch.einsum("bid,iod->bo", basis_ref(torch.tanh(xd), degree, basis), cd)
    dxr, dcr = torch.autograd.grad(yr, [xd, cd], gy.double())
    errors = {"y": rel(y, yr), "dx": rel(dx, dxr), "dC": rel(dc, dcr)}
    assert all(e < tol for e in errors.values()), errors


@pytest.mark.parametrize("basis", BASES)
@pytest.mark.parametrize("degree", [3, 8, 24])
def test_lut_forward_and_gradients(basis, degree):
    """Fused regime, LUT: the basis kernel (table once per element), the split forward, the fused backward."""
    _check_layer(basis, degree, "lut")


@pytest.mark.parametrize("basis", BASES)
@pytest.mark.parametrize("degree", [3, 8, 24])
def test_recurrence_mode(basis, degree):
    """Fused regime, exact recurrence carried through the degree loop inside the contraction kernels."""
    _check_layer(basis, degree, "recurrence", sizes=(19, 21, 17))


# every basis at degrees 3 and 8; degree 24 (covered per basis in the fused regime above) for hermite, the widest
# range of values: the interpreter's time
@pytest.mark.parametrize("basis, degree", [(b, d) for b in BASES for d in (3, 8)] + [("hermite", 24)])
@pytest.mark.parametrize("basis_eval", ["lut", "recurrence"])
def test_gemm_regime(basis, degree, basis_eval):
    """GEMM regime: split operands (tf32 parts), transposes, the basis kernel's three outputs, dX epilogue."""
    _check_layer(basis, degree, basis_eval, sizes=(21, 19, 23), regime="gemm")


def test_lut_forward_group_evaluation():
    """The LUT forward evaluates the table inside the kernel: the members' degree shares cover Phi and dPhi
    (fallback off), and members that do not wait evaluate everything themselves (same bits)."""
    op = _in_regime(ncd.families.polykan.plan.basis_op("hermite", 8, "lut"), "fused")
    x = torch.randn(23, 37)
    c = torch.randn(9, 37, 19) / 37  # kernel layout [deg, in, out]
    y, (phi, dphi) = op.module.forward_impl(x, c, 19, True, True)
    plans = [p for key, p in op.module._PLANS.items() if key[:3] == (23, 37, 19)]
    assert plans and all(p.til.fwd_tiles_n > 1 for p in plans)
    # shares only (the interpreter's early members stop waiting at once)
    shares = op.with_config(lut_fallback=False)
    _, (phi2, dphi2) = shares.module.forward_impl(x, c, 19, True, True)
    assert torch.equal(phi2, phi) and torch.equal(dphi2, dphi)
    everyone = op.with_config(lut_wait_spins=0)  # nobody waits: everyone evaluates everything
    y3, (phi3, _) = everyone.module.forward_impl(x, c, 19, True, True)
    assert torch.equal(y3, y) and torch.equal(phi3, phi)
    assert {shares.config.regime, everyone.config.regime} == {"fused"}  # the overrides add up


@pytest.mark.parametrize("regime", ["fused", "gemm"])
def test_bf16x3_parts(regime):
    """matmul=bf16x3: bf16 hi + lo parts (about 2^-16 relative per product: within the tolerance)."""
    _check_layer("chebyshev", 8, "lut", sizes=(21, 19, 23), regime=regime, matmul="bf16x3")


@pytest.mark.parametrize("regime", ["fused", "gemm"])
@pytest.mark.parametrize("basis_eval", ["lut", "recurrence"])
def test_one_gradient_and_no_grad(regime, basis_eval):
    """Only dX, only dC, and the no-grad forward; the compile-path entry points (forward / backward)."""
    op = ncd.families.polykan.plan.basis_op("legendre", 8, basis_eval)
    x = torch.randn(17, 21, dtype=torch.float64)
    c = torch.randn(21, 13, 9, dtype=torch.float64) / 21
    xd, cd = x.clone().requires_grad_(True), c.clone().requires_grad_(True)
    yr = torch.einsum("bid,iod->bo", basis_ref(torch.tanh(xd), 8, "legendre"), cd)
    gy = torch.randn_like(yr)
    dxr, dcr = torch.autograd.grad(yr, [xd, cd], gy)
    op = _in_regime(op, regime)
    module = op.module
    with torch.no_grad():
        assert rel(op(x.float(), c.float()), yr) < TOL
    xf = x.float().requires_grad_(True)
    (dx,) = torch.autograd.grad(op(xf, c.float()), [xf], gy.float())
    assert rel(dx, dxr) < TOL
    cf = c.float().requires_grad_(True)
    (dc,) = torch.autograd.grad(op(x.float(), cf), [cf], gy.float())
    assert rel(dc, dcr) < TOL
    ck = c.float().permute(2, 0, 1).contiguous()
    assert rel(module.forward(x.float(), ck), yr) < TOL
    dxk, dck = module.backward(gy.float(), x.float(), ck)
    assert rel(dxk, dxr) < TOL and rel(dck.permute(1, 2, 0), dcr) < TOL


@pytest.mark.parametrize("regime", ["fused", "gemm"])
@pytest.mark.parametrize("basis_eval", ["lut", "recurrence"])
def test_saturated_inputs_give_finite_gradients(basis_eval, regime):
    op = ncd.families.polykan.plan.basis_op("chebyshev", 8, basis_eval)
    x = torch.where(torch.rand(9, 13) < 0.5, -1.0, 1.0) * (10 + 20 * torch.rand(9, 13))
    x[0, 0] = 1e30
    x.requires_grad_(True)
    c = torch.randn(13, 11, 9, requires_grad=True)
    op = _in_regime(op, regime)
    y = op(x, c)
    dx, dc = torch.autograd.grad(y, [x, c], torch.randn_like(y))
    assert torch.isfinite(y).all() and torch.isfinite(dx).all() and torch.isfinite(dc).all()
    # at u = +-1 the basis is exact: T_d(1) = 1, T_d(-1) = (-1)^d
    signs = torch.sign(x.detach())
    phi = torch.stack([signs ** d for d in range(9)], dim=-1)
    assert rel(y, torch.einsum("bid,iod->bo", phi.double(), c.detach().double())) < TOL


@pytest.mark.parametrize("path", [ROOT / "specs" / f for f in SPEC_FILES.values()], ids=lambda p: p.name)
def test_validate_rows_for_shipped_specs(path):
    with raise_float_errors():
        rows = validate(ncd.load(path))
    assert [r.quantity for r in rows] == ["y", "dx", "dC"]
    assert all(r.ok for r in rows), rows


def test_modules_read_the_shipped_specs():
    for basis, name in SPEC_FILES.items():
        assert (ROOT / "specs" / name).read_text(encoding="utf-8") == SPECS[basis]
        assert spec_path(basis).resolve() == (ROOT / "specs" / name).resolve()


def test_plan_states_table_and_error():
    plan = find_plan(load_spec(ROOT / "specs" / "cheby_kan.ncd"))
    text = "\n".join(plan.describe())
    assert plan.family == "polykan" and plan.basis_eval == "lut"
    assert "t = theta = acos(u)" in text and "measured basis max relative error" in text
    table = plan.table
    assert table.param.name.startswith("theta") and table.error <= table.budget and table.derror <= table.budget
    assert f"{table.entries} entries" in text
    # the theta table is measured smaller than the u table (the choice is by measurement)
    needed = dict(plan.choice.needed)
    assert needed["theta = acos(u)"] < needed["u"]
    assert "kernel [deg inp outp]" in text and "split" in text


def test_table_error_budget_degree_24():
    """The requirement: basis max relative error <= 1e-4 up to degree 24 in fp32, values and derivatives."""
    for basis in BASES:
        program = front_end(SPECS[basis], "x.ncd", sizes={"deg": 25}).program
        choice = choose_table(Recurrence.from_ir(program.bases[0]), 25, -1.0, 1.0, 1e-4)
        assert choice.table is not None and choice.table.error <= 1e-4 and choice.table.derror <= 1e-4


def test_derivative_recurrence_is_derived():
    rec = Recurrence.from_ir(front_end(SPECS["hermite"], "x.ncd").program.bases[0])
    import numpy as np

    u = np.linspace(-1, 1, 11)
    values, derivs = rec.evaluate(u, 6)
    # H_n' = 2 n H_{n-1}
    for n in range(1, 6):
        assert np.allclose(derivs[:, n], 2 * n * values[:, n - 1])


def test_generated_module_origins_and_flags():
    op = ncd.families.polykan.plan.basis_op("legendre", 8)
    text = op.path.read_text()
    ast.parse(text)
    assert "# legendre_kan.ncd:" in text and "CONFIG = PolyKANConfig(" in text
    assert "POISON_OUTPUTS" not in text and "FORCE_REGIME" not in text  # choices are the config's, not globals
    assert "acos" not in text.split("def _darg", 1)[1].split("return", 1)[1].split("\n", 1)[0]


def test_size_override_and_cache_key():
    path = ROOT / "specs" / "cheby_kan.ncd"
    a, b = load_spec(path), load_spec(path, sizes={"deg": 4})
    assert b.program.axis("deg").fixed == 4 and a.program.axis("deg").fixed == 9
    assert op_id(a) != op_id(b) != op_id(load_spec(path, options={"basis_eval": "recurrence"}))
    with pytest.raises(UnknownAxis):
        load_spec(path, sizes={"degree": 4})
    with pytest.raises(SizeMismatch):
        load_spec(path, sizes={"batch": 4})
    with pytest.raises(SizeMismatch):
        load_spec(path, sizes={"deg": 0})
    with pytest.raises(UnsupportedPolyKAN):
        plan_polykan(load_spec(path, options={"basis_eval": "magic"}), {})
    op = ncd.load(path, sizes={"deg": 4})
    with pytest.raises(NcdError):  # call-time check names the axis
        op(torch.randn(3, 5), torch.randn(5, 2, 9))


def test_recognised_but_unsupported_is_located():
    text = SPECS["chebyshev"].replace("T[deg](tanh(x))", "T[deg](tanh(x) * x[batch inp])").replace(
        "in    x[batch inp] : f32", "in    x[batch inp] : f32\nin    z[batch inp] : f32").replace(
        "tanh(x) * x[batch inp]", "tanh(x) * z")
    front = front_end(text, "bad.ncd")
    with pytest.raises(UnsupportedPolyKAN) as err:
        plan_polykan(front, {})
    assert err.value.span is not None
    with pytest.warns(FallbackWarning, match=f"polykan: bad.ncd:{err.value.span.line}:"):
        assert select(front).family.name == "generic"  # the spec still compiles, from its IR


def test_unbounded_argument_falls_back_to_recurrence():
    text = SPECS["legendre"].replace("P[deg](tanh(x))", "P[deg](x)")
    plan = find_plan(front_end(text, "free.ncd", sizes={"deg": 4}))
    assert plan.basis_eval == "recurrence" and "unbounded" in "\n".join(plan.describe())


def test_chebykan_layer_is_a_drop_in():
    class Reference(torch.nn.Module):  # ChebyKAN's layer, verbatim in substance
        def __init__(self, input_dim, output_dim, degree):
            super().__init__()
            self.inputdim, self.outdim, self.degree = input_dim, output_dim, degree
            self.cheby_coeffs = torch.nn.Parameter(torch.empty(input_dim, output_dim, degree + 1))
            torch.nn.init.normal_(self.cheby_coeffs, mean=0.0, std=1 / (input_dim * (degree + 1)))
            self.register_buffer("arange", torch.arange(0, degree + 1, 1))

        def forward(self, x):
            x = torch.tanh(torch.reshape(x, (-1, self.inputdim)))
            x = x.view((-1, self.inputdim, 1)).expand(-1, -1, self.degree + 1).acos() * self.arange
            return torch.einsum("bid,iod->bo", x.cos(), self.cheby_coeffs).view(-1, self.outdim)

    ref = Reference(7, 5, 3)
    for layout in ("kernel", "spec"):
        layer = ChebyKANLayer(7, 5, 3, layout=layout)
        assert {k: v.shape for k, v in layer.state_dict().items()} == {k: v.shape for k, v in ref.state_dict().items()}
        layer.load_state_dict(ref.state_dict())
        x = torch.randn(2, 3, 7, requires_grad=True)  # leading dims flattened, as ChebyKAN does
        assert rel(layer(x), ref(x)) < TOL
        ref.load_state_dict(layer.state_dict())
        # a training step keeps the layout (the optimizer state and the gradient follow the parameter's strides)
        opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
        layer(x).square().sum().backward()
        opt.step()
        assert layer.cheby_coeffs.grad.stride() == layer.cheby_coeffs.stride()
    kernel = ChebyKANLayer(7, 5, 3, layout="kernel")
    assert kernel.cheby_coeffs.permute(2, 0, 1).is_contiguous()  # stored in the kernel layout
    assert ChebyKANLayer(7, 5, 3).cheby_coeffs.is_contiguous()  # the default: ChebyKAN's contiguous layout
    std = ChebyKANLayer(200, 300, 4).cheby_coeffs.std().item()
    assert abs(std - 1 / (200 * 5)) < 0.05 / (200 * 5)


def test_polykan_layer_bases():
    for basis in BASES:
        layer = PolyKANLayer(6, 4, 5, basis=basis)
        x = torch.randn(3, 6, dtype=torch.float64)
        ref = torch.einsum("bid,iod->bo", basis_ref(torch.tanh(x), 5, basis), layer.coeffs.detach().double())
        assert rel(layer(x.float()), ref) < TOL
    with pytest.raises(ValueError):
        PolyKANLayer(6, 4, 5, basis="bessel")


def test_ops_share_static_kernels_keyed_by_their_hooks():
    """Chebyshev and Hermite at the same degree and mode differ only in their hooks (the spec's device functions):
    interleaved in one process, each must get its own compiled kernels from the one static kernel set. The
    generated modules never import the planner; their config is the plan's, as a literal."""
    cheb = ncd.families.polykan.plan.basis_op("chebyshev", 3, "recurrence")
    herm = ncd.families.polykan.plan.basis_op("hermite", 3, "recurrence")
    assert cheb.module._RUNTIME is not herm.module._RUNTIME and cheb.module.DEGREES == herm.module.DEGREES
    assert cheb.module._RUNTIME.hooks.next is not herm.module._RUNTIME.hooks.next
    for op in (cheb, herm):
        text = op.path.read_text()
        assert "ncd.families.polykan.plan" not in text and "ncd.families.rational.plan" not in text
        assert find_plan(op.front).config == op.module.CONFIG and op.module.CONFIG.basis_eval == "recurrence"
    for basis in ("chebyshev", "hermite", "chebyshev"):
        _check_layer(basis, 3, "recurrence", sizes=(19, 21, 17))


def test_lut_table_travels_bit_exact():
    """The generated module carries the plan's table compressed (xz, base85): it decodes to the same fp32 bits."""
    op = ncd.families.polykan.plan.basis_op("hermite", 3, "lut")
    table = find_plan(op.front).table
    expected = torch.from_numpy(np.stack([table.values, table.derivs]).astype("<f4"))
    assert torch.equal(op.module._TABLE_HOST, expected.view(op.module._TABLE_HOST.shape))
    assert op.module.CONFIG.lut_entries == table.entries and table.entries == op.module.ENTRIES


def test_basis_rules_may_read_axis_sizes():
    """size(deg) in a basis rule is the axis' size (it was an unlocated TypeError): here a factor of exactly 1."""
    text = SPECS["legendre"].replace("/ (n + 1)", "/ (n + 1) * size(deg) / 9")
    assert "size(deg)" in text
    scaled = find_plan(front_end(text, "same.ncd", sizes={"deg": 9}))
    plain = find_plan(front_end(SPECS["legendre"], "same.ncd", sizes={"deg": 9}))
    assert scaled.describe()[3:12] == plain.describe()[3:12]
