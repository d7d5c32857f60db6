"""The generic family: specs no specialised family claims compile to a PyTorch function of their IR, match the
float64 reference forward and backward, are validated by `ncd check`, and are rejected (located) where the
generic family cannot honour a node."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import ncd
from ncd.backend import plan
from ncd.errors import CallError, InvalidStatement
from ncd.families.generic import emit, plan_generic
from ncd.pipeline import front_end
from ncd.validate import check_op

ROOT = Path(__file__).resolve().parent.parent
GENERIC_SPECS = ["rmsnorm_matmul", "swiglu_mlp", "channel_softmax", "matmul_bias_gelu", "gelu", "prelu",
                 "ungrouped_rational"]
DTYPES = (torch.float32, torch.bfloat16)


def spec_path(name: str) -> Path:
    return ROOT / "specs" / f"{name}.ncd"


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("generic-cache")


def load(path: Path, cache: Path) -> ncd.ops.Op:
    return ncd.load(path, cache_dir=cache)


def _failures(results) -> list[str]:
    return [f"{case.label} {case.dtype_name} {row}" for case, report in results for row in report if not row.ok]


@pytest.mark.parametrize("name", GENERIC_SPECS)
def test_spec_matches_reference(name, cache):
    """No specialised family claims the spec; the op matches the float64 reference in every case `ncd check` runs
    (fp32 normal / x64 / exact zeros, bf16), forward and the gradient of every input and parameter."""
    op = load(spec_path(name), cache)
    assert plan(op.front).family == "generic"
    results = check_op(op, DTYPES, "cpu", seed=11)
    assert [(c.draw, c.dtype) for c, _ in results] == [("normal", torch.float32), ("large", torch.float32),
                                                       ("zeros", torch.float32), ("normal", torch.bfloat16)]
    assert _failures(results) == []
    program = op.front.program
    expected = {t.name for t in program.outputs} | {f"d{t.name}" for t in (*program.inputs, *program.params)}
    for _, report in results:
        assert {r.quantity for r in report} == expected


def test_call_time_errors_name_tensor_and_axis(cache):
    op = load(spec_path("rmsnorm_matmul"), cache)
    x, g = torch.randn(5, 7), torch.randn(7)
    with pytest.raises(CallError, match=r"W: axis 'dim' has size 6, but x has 7"):
        op(x, g, torch.randn(6, 3))
    with pytest.raises(CallError, match=r"g must have 1 dims \[dim\]"):
        op(x, torch.randn(7, 1), torch.randn(7, 3))
    with pytest.raises(CallError, match=r"x has dtype torch.int64"):
        op(torch.ones(5, 7, dtype=torch.long), g, torch.randn(7, 3))


@pytest.mark.parametrize("name", GENERIC_SPECS)
def test_cli_check_validates_numerics(name, run_cli):
    code, out, err = run_cli("check", str(spec_path(name)), "--seed", "3")
    assert code == 0, out + err
    assert "ok   numerics   4 of 4 cases passed" in out
    assert re.search(r"^\s+y\s+float32\s+\S+\s+1e-04\s+\S+\s+4e-04\s+ok$", out, re.M), out
    assert "default / large" in out and "default / zeros" in out and "bfloat16" in out


@pytest.mark.parametrize("name", GENERIC_SPECS)
def test_emit_plan_says_generic(name, run_cli):
    code, out, _ = run_cli("compile", str(spec_path(name)), "--emit", "plan")
    assert code == 0
    assert out.splitlines()[0] == "family: generic"


def test_unstabilisable_exponential_is_rejected_with_its_location(tmp_path, run_cli):
    spec = tmp_path / "bad_norm.ncd"
    spec.write_text("spec bad_norm\naxis batch, chan\nin x[batch chan] : f32\n"
                    "out y[batch chan] = normalize(x, over chan, a1(v) = exp(v), a2(v) = exp(v), b(z) = sqrt(z))\n")
    code, out, err = run_cli("check", str(spec))
    assert code == 1
    assert f"{spec}:4:21: error[invalid]: the generic family cannot compile this normalize safely" in err
    assert "not homogeneous of degree 1" in err and "ok   numerics" not in out
    assert run_cli("compile", str(spec), "--emit", "plan")[0] == 1


def test_spelled_out_softmax_is_stabilised(tmp_path):
    """exp(x) / sum(exp(x), over chan), through an intermediate, runs as exp(x - m) / sum(exp(x - m)): the x64
    draws pass, and the unused exp(x) intermediate is not computed."""
    spec = tmp_path / "spelled.ncd"
    spec.write_text("spec spelled\naxis batch, chan\nin x[batch chan] : f32\ne[batch chan] = exp(x)\n"
                    "out y[batch chan] = e / sum(e, over chan)\n")
    op = load(spec, tmp_path)
    assert "torch.exp(x)" not in op.path.read_text() and "amax" in op.path.read_text()
    assert _failures(check_op(op, (torch.float32,), "cpu", seed=6)) == []


@pytest.mark.parametrize("form", ["e / (1 + sum(e, over chan))", "x - log(sum(e, over chan))"])
def test_other_ratios_of_exponential_sums_are_rejected(form):
    """What no max subtraction is derived for (a ratio that is not the softmax, a spelled-out log-sum-exp) is
    rejected at the division or log, pointing to normalize; a bounded exponential (exp(-x^2)) compiles."""
    text = "spec spelled\naxis batch, chan\nin x[batch chan] : f32\ne[batch chan] = exp({})\n" \
           "out y[batch chan] = {}\n"
    with pytest.raises(InvalidStatement, match=r"by a sum over 'chan' of exp\(\.\.\.\) \(line 4\)") as err:
        plan(front_end(text.format("x", form), "spelled.ncd"))
    assert err.value.span.line == 5 and "normalize(S, over chan" in err.value.hint
    assert plan(front_end(text.format("-x^2", form), "gauss.ncd")).family == "generic"


SCAN = """spec gated_scan
axis batch, time, dim
in x[batch time dim] : f32
in g[batch time] : f32
in h0[batch dim] : f32
h[batch time dim] = scan(sigmoid(g) * prev + (1 - sigmoid(g)) * tanh(x) + time / size(time), over time, init = h0)
u[batch time dim] = scan(prev * 0.5 + x, over time)
out y[batch time dim] = h * u
"""


def _generic_module(front) -> dict:
    """The generic family's module for `front`, executed (for specs a specialised family claims first)."""
    from ncd.backend import op_id

    namespace: dict = {"__name__": "generic_module"}
    exec(compile(plan_generic(front, {}).render(front.program, op_id(front)), "generic_module", "exec"), namespace)
    return namespace


def test_scans_run_step_by_step():
    """A scan reaches the generic family where the recurrence family declines it: a loop over the time axis,
    matching the reference (initial state, zero start, time index, size(time)) forward and backward."""
    from ncd.reference import evaluate

    front = front_end(SCAN, "gated_scan.ncd")
    fn = _generic_module(front)["gated_scan"]
    gen = torch.Generator().manual_seed(1)
    args = {n: torch.randn(shape, generator=gen, dtype=torch.float64)
            for n, shape in (("x", (2, 7, 3)), ("g", (2, 7)), ("h0", (2, 3)))}
    leaves = {n: v.float().requires_grad_() for n, v in args.items()}
    ref_leaves = {n: v.clone().requires_grad_() for n, v in args.items()}
    out, ref = fn(**leaves), evaluate(front.program, ref_leaves)["y"]
    grad_out = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(out, list(leaves.values()), grad_out.float())
    for got, want in zip(grads, torch.autograd.grad(ref, list(ref_leaves.values()), grad_out), strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    assert fn(torch.randn(2, 0, 3), torch.randn(2, 0), torch.randn(2, 3)).shape == (2, 0, 3)


RIDGE = """spec ridge
axis batch, j
axis kdim = 5
axis kcol = kdim
in k[batch kdim j] : f32
in q[batch kdim] : f32
const lam = 0.5
H[batch kdim kcol] = k . k[batch kcol j] over j
normH[batch] = sqrt(sum(H * H, over kdim kcol))
out x[batch kcol] = chebyshev_solve(H + lam * where(kdim == kcol, 1, 0), q, over kcol, iterations = 30, mu = lam,
                                    L = normH + lam)
"""


def test_chebyshev_solve_is_differentiated_as_the_exact_solve(tmp_path):
    """A ridge solve outside any recurrence: the iterations forward and the exact solve's gradient backward, as the
    reference does (validate's note says how far autograd through the iterations would be)."""
    spec = tmp_path / "ridge.ncd"
    spec.write_text(RIDGE)
    op = load(spec, tmp_path)
    assert "class _ImplicitSolve" in op.path.read_text()
    results = check_op(op, DTYPES, "cpu", seed=4)
    assert _failures(results) == [] and {r.quantity for r in results[0][1]} == {"x", "dk", "dq"}
    assert any("differentiated as the exact solve" in note for note in results[0][1].notes)


def test_an_axis_no_argument_carries_is_rejected_at_its_declaration():
    front = front_end("spec nosize\naxis row, n\nin x[row] : f32\nout y[row] = x * size(n)\n", "nosize.ncd")
    with pytest.raises(InvalidStatement, match="no input or parameter carries it") as err:
        plan_generic(front, {})
    assert (err.value.span.line, err.value.span.col) == (2, 11)


def test_large_draws_find_an_unstabilised_softmax(tmp_path, monkeypatch):
    """Without the max subtraction, exp(x) of x64 logits overflows fp32: the check's large draw must fail."""
    monkeypatch.setattr(emit.BodyEmitter, "stabiliser", lambda self, node: None)
    spec = tmp_path / "channel_softmax.ncd"  # other text, so another op id; a cache of its own: wrong on purpose
    spec.write_text(spec_path("channel_softmax").read_text() + "# without the max subtraction\n")
    op = load(spec, tmp_path)
    assert "amax" not in op.path.read_text()
    results = check_op(op, DTYPES, "cpu", seed=5, only=lambda c: c.draw == "large")
    assert len(results) == 1 and _failures(results)


def test_origin_comments_on_every_body_line(cache):
    for name in GENERIC_SPECS:
        text = load(spec_path(name), cache).path.read_text()
        body = text.split("def _body(", 1)[1].split("\n\n\n", 1)[0].split('"""')[-1].splitlines()
        computed = [line for line in body if line.strip() and not line.strip().startswith(("_device =", "_one ="))]
        assert computed and all(re.search(rf"  # {name}\.ncd:\d+$", line) for line in computed), name


def test_spelled_out_exponentials_are_stabilised(tmp_path):
    """x / (1 + exp(-x)) as written has the derivative inf / inf below x = -88 in fp32; it is printed in
    ncd.stable_exp's form (u = exp(-|x|) per branch), so the large draws and exact zeros pass."""
    spec = tmp_path / "silu_spelled.ncd"
    spec.write_text("spec silu_spelled\naxis row, dim\nin x[row dim] : f32\nout y[row dim] = x / (1 + exp(-x))\n")
    op = load(spec, tmp_path)
    assert "clamp(max=0.0)" in op.path.read_text()
    assert _failures(check_op(op, (torch.float32,), "cpu", seed=2)) == []


MIXED = """spec mixed
axis row, group = 3, width, key
axis chan = group * width
axis deg = 4
basis T(u) {
  T[0] = 1
  T[1] = u
  T[n+1] = 2*u*T[n] - T[n-1]
}
in    x[row chan] : f32
in    k[row key] : f32
in    s : f32
in    temp : f32 = 1 / sqrt(size(key))
param a[group] : f32
param m[key] : f32
param c[deg] : f32
g[row chan] = x * a + s
w[row key] = normalize(k * temp, over key, a1(v) = exp(v), a2(v) = exp(v), b(z) = z, mask = key <= row, weight = m * m)
out y[row chan] = g * sum(w * k, over key) + sum(c[i] * T[i](tanh(x)) for i in 0..3)
out p[row chan deg] = T[deg](tanh(x)) * max(x, 0.1 * x)
"""


def test_mixed_constructs(tmp_path):
    """Factor absorption (a[group] read per channel), a required scalar input (drawn, with its gradient) and one
    defaulted from a call-time size, a masked and weighted softmax (stabilised), finite sums, basis evaluations and
    two outputs. The x64 draw is left out: weights m^2 ~ 4000 on saturated rows make dm ill-conditioned (the fp32
    reference itself is 1e-3 off float64 there)."""
    spec = tmp_path / "mixed.ncd"
    spec.write_text(MIXED)
    op = load(spec, tmp_path)
    results = check_op(op, DTYPES, "cpu", seed=3, only=lambda c: c.draw != "large")
    assert len(results) == 3 and _failures(results) == []
    assert {r.quantity for r in results[0][1]} == {"y+p", "dx", "dk", "ds", "da", "dm", "dc"}
    x, k = torch.randn(4, 6), torch.randn(4, 5)
    params = torch.randn(3), torch.randn(5), torch.randn(4)
    default = op(x, k, *params, s=0.5)
    explicit = op(x, k, *params, s=0.5, temp=5 ** -0.5)
    assert all(torch.equal(d, e) for d, e in zip(default, explicit, strict=True))


def test_module_holds_parameters(cache):
    op = load(spec_path("rmsnorm_matmul"), cache)
    g, w, x = torch.randn(7), torch.randn(7, 3), torch.randn(5, 7)
    module = op.Module(g, w)
    assert {n: p.shape for n, p in module.named_parameters()} == {"g": (7,), "W": (7, 3)}
    out = module(x)
    assert torch.equal(out, op(x, g, w))
    out.sum().backward()
    assert module.W.grad is not None and module.g.grad is not None


def test_compile_policy(cache, monkeypatch):
    """Default: eager on CPU tensors (no torch.compile, so no C++ toolchain); NCD_GENERIC_COMPILE is checked."""
    from ncd.settings import settings

    op = load(spec_path("gelu"), cache)
    assert op.module.COMPILE == "cuda"
    op(torch.randn(3, 5))
    assert op.module._COMPILED == {}
    monkeypatch.setenv("NCD_GENERIC_COMPILE", "never")
    assert settings().generic_compile == "never"
    monkeypatch.setenv("NCD_GENERIC_COMPILE", "sometimes")
    with pytest.raises(ValueError, match="NCD_GENERIC_COMPILE"):
        settings()


@pytest.mark.parametrize("name", ["swiglu_mlp", "channel_softmax"])
def test_traces_as_one_graph(name, cache):
    """torch.compile(fullgraph=True) traces the function without graph breaks (aot_eager: no C++ toolchain on
    CPU; Inductor takes the same graph on CUDA), and gives eager's values and gradients."""
    op = load(spec_path(name), cache)
    module = op.module
    sizes = plan(op.front).validation_sizes(op.front.program)
    gen = torch.Generator().manual_seed(0)
    args = [torch.randn([sizes[a] for a in t.axes], generator=gen).requires_grad_() for t in op.signature]
    eager = op(*args)
    eager_grads = torch.autograd.grad(eager.square().sum(), args)
    saved = module.COMPILE, module.COMPILE_BACKEND
    module.COMPILE, module.COMPILE_BACKEND = "always", "aot_eager"
    try:
        compiled = op(*args)
        assert "aot_eager" in module._COMPILED
    finally:
        module.COMPILE, module.COMPILE_BACKEND = saved
        module._COMPILED.clear()
    grads = torch.autograd.grad(compiled.square().sum(), args)
    torch.testing.assert_close(compiled, eager)
    for got, want in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(got, want)


def test_generated_code_is_ruff_clean_with_long_names(tmp_path):
    """Long file and tensor names push lines past 120 columns: the renderer wraps them (docstrings, argument
    lists, body lines) so that the module stays clean under the project's ruff configuration."""
    from ncd.backend import generate
    from ncd.lint import lint_generated

    long = "a_rather_long_tensor_name_that_a_careful_person_might_write"
    text = MIXED.replace("x[", f"{long}[").replace("x *", f"{long} *").replace("(x)", f"({long})").replace(
        "(x,", f"({long},").replace("0.1 * x", f"0.1 * {long}").replace("k[", "key_matrix_with_a_long_name[").replace(
        "param m[", f"param {long}_m[").replace("m * m", f"{long}_m * {long}_m")
    text = text.replace("w * k,", "w * key_matrix_with_a_long_name,").replace("normalize(k *", "normalize("
                                                                              "key_matrix_with_a_long_name *")
    spec = tmp_path / f"{'very_long_spec_file_name_' * 3}.ncd"
    spec.write_text(text)
    front = front_end(text, str(spec))
    assert lint_generated(generate(front), "mixed_long") == []


def test_large_draws_stay_where_the_true_result_fits_fp32(tmp_path):
    """exp(x) alone overflows fp32 at x64 draws because its value does: the large case then draws x8 instead of
    failing an op that is right."""
    spec = tmp_path / "expo.ncd"
    spec.write_text("spec expo\naxis row, dim\nin x[row dim] : f32\nout y[row dim] = exp(x)\n")
    results = check_op(load(spec, tmp_path), (torch.float32,), "cpu", seed=1, only=lambda c: c.draw == "large")
    assert len(results) == 1 and _failures(results) == []


LINEAR_RNN = """spec linear_rnn
axis batch, time, head
axis kdim = 6
axis vdim = 5
in  q[batch time head kdim] : f32
in  k[batch time head kdim] : f32
in  v[batch time head vdim] : f32
in  g[batch time head vdim] : f32
S[batch time head vdim kdim] = scan(exp(g) * prev + v * k, over time)
out o[batch time head vdim] = S . q over kdim
"""


def test_a_scan_the_recurrence_family_cannot_compile_falls_back_to_generic(tmp_path, run_cli):
    """Gated linear attention with a gate per value dimension (fla's `gv`): the recurrence family recognises the
    scan but compiles gates per head, token or key dimension only, so it declines at the gate's declaration and the
    generic family compiles the spec; `ncd check` validates it."""
    spec = tmp_path / "linear_rnn.ncd"
    spec.write_text(LINEAR_RNN)
    code, out, err = run_cli("compile", str(spec), "--emit", "plan")
    assert code == 0, err
    assert out.startswith("family: generic")
    assert ("declined by recurrence: linear_rnn.ncd:8:1: recognised, but: declare g as [batch time head] (a gate "
            "per token and head), [batch time head kdim] (a gate per key dimension: GLA)") in out
    assert "ncd: note: recurrence: linear_rnn.ncd:8:1:" in err
    code, out, err = run_cli("check", str(spec))
    assert code == 0, out + err
    assert "ok   numerics" in out and "dg" in out


def test_generic_failing_too_reports_the_specialised_familys_error(tmp_path):
    """Where the generic family cannot compile the spec either, the error is the first specialised family's: the
    one that recognised the spec says what to change for the fast path."""
    from ncd.errors import NcdError

    text = LINEAR_RNN.replace("out o[batch time head vdim] = S . q over kdim",
                              "T[batch time head vdim] = sum(S, over kdim)\n"
                              "out o[batch time head vdim] = scan(prev + sum(T, over time), over time)")
    front = front_end(text, str(tmp_path / "nested.ncd"))
    with pytest.raises(NcdError) as err:
        plan(front)
    assert err.value.code in {"unsupported", "not-streamable"}, err.value.render()
