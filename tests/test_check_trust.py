"""`ncd check` cannot be fooled: each sabotage below passed the old check (fp32, one N(0, 1) draw, the default
form, one whole-tensor norm). Each is applied to a shipped spec's generated module, by monkeypatching one of
its functions or by a textual edit of a private copy of its code, and the case of `ncd check` that reaches it
must fail while the same case passes on the untouched module. Specs are compiled at small head dims where the
head dim is fixed (the same generated code, cheaper in the interpreter)."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path

import torch

import ncd
from ncd.ops import Op
from ncd.validate import Case, case_inputs, check_op, validate
from ncd.validation_forms import forms_for

ROOT = Path(__file__).resolve().parent.parent
SPECS = ROOT / "specs"


def _load(stem: str, cache: Path, **sizes: int) -> Op:
    return ncd.load(SPECS / f"{stem}.ncd", cache_dir=cache, sizes=sizes or None)


def _edited(op: Op, tmp_path: Path, old: str, new: str) -> Op:
    """A private copy of the op's generated module with `old` (a regular expression) replaced by `new`, under
    a fresh op id (torch.library ops are global per process)."""
    text = op.path.read_text(encoding="utf-8")
    ident = op.path.stem
    changed, count = re.subn(old, new, text)
    assert count > 0, f"{old!r} not in the generated code"
    fresh = f"{ident}_sabotaged_{abs(hash((old, new))) % 10**8}"
    path = tmp_path / f"{fresh}.py"
    path.write_text(changed.replace(ident, fresh), encoding="utf-8")
    spec = importlib.util.spec_from_file_location(f"ncd_sabotage_{fresh}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return Op(dataclasses.replace(op.compiled, module=module, path=path))


def _run(op: Op, form: str, draw: str, dtype: torch.dtype = torch.float32) -> list:
    """The rows of `ncd check`'s case (form, draw, dtype); the case must be one `ncd check` runs."""
    cases = forms_for(op).cases((torch.float32, torch.bfloat16))
    wanted = [c for c in cases if (c.form, c.draw, c.dtype) == (form, draw, dtype)]
    assert len(wanted) == 1, f"`ncd check` runs no case {form} / {draw} / {dtype}: {cases}"
    results = check_op(op, only=lambda c: c == wanted[0])
    assert [c for c, _ in results] == wanted
    return list(results[0][1])


def _assert_caught(clean: Op, sabotaged: Op, form: str, draw: str, dtype: torch.dtype = torch.float32) -> None:
    good = _run(clean, form, draw, dtype)
    assert all(r.ok for r in good), [r for r in good if not r.ok]
    bad = _run(sabotaged, form, draw, dtype)
    assert not all(r.ok for r in bad), bad


def test_factorized_attention_off_by_two_percent(tmp_path, monkeypatch):
    op = _load("spherical_attention", tmp_path, dim=16)
    assert all(r.ok for r in _run(op, "factorized", "normal"))
    factorized = op.with_config(factorize="always").module  # the op `ncd check` runs the factorized form on
    forward_factorized = factorized.forward_factorized

    def two_percent_off(*args, **kwargs):
        o, stats = forward_factorized(*args, **kwargs)
        return o * 1.02, stats

    monkeypatch.setattr(factorized, "forward_factorized", two_percent_off)
    assert all(r.ok for r in validate(op))  # the old check ran the default (streamed) form only
    assert not all(r.ok for r in _run(op, "factorized", "normal"))


def test_bf16_only_bug(tmp_path, monkeypatch):
    op = _load("softmax_attention", tmp_path, dim=16)
    assert all(r.ok for r in _run(op, "streamed", "normal", torch.bfloat16))
    forward = op.module.forward

    def wrong_in_bf16(q, k, v, w, scale, *rest, **kw):
        o, stats = forward(q, k, v, w, scale, *rest, **kw)
        return (o * 1.03 if q.dtype == torch.bfloat16 else o), stats

    monkeypatch.setattr(op.module, "forward", wrong_in_bf16)
    assert all(r.ok for r in validate(op))  # fp32 only, as the old check on the CPU
    assert not all(r.ok for r in _run(op, "streamed", "normal", torch.bfloat16))


def test_multiplicity_zero_treated_as_one(tmp_path, monkeypatch):
    draw = "zeros"  # zero multiplicities (the "masked" draw catches it as well)
    clean = _load("causal_gqa_spherical", tmp_path, dim=16)
    assert all(r.ok for r in _run(clean, "streamed", draw))
    streamed = clean.with_config(factorize="never").module  # the op `ncd check` runs the streamed form on
    forward = streamed.forward

    def zero_as_one(q, k, v, w, scale, *rest, **kw):
        return forward(q, k, v, torch.where(w == 0, 1.0, w) if w is not None else w, scale, *rest, **kw)

    monkeypatch.setattr(streamed, "forward", zero_as_one)
    assert all(r.ok for r in validate(clean))  # multiplicities drawn in [0.5, 2): never 0
    assert not all(r.ok for r in _run(clean, "streamed", draw))


def test_sign_of_zero_regressed(tmp_path):
    clean = _load("group_rational", tmp_path)
    # sign+(0) = +1 becomes sign(0) = 0 in the backward: `where(t >= 0, 1, where(t < 0, -1, t))` -> `t > 0`
    sabotaged = _edited(clean, tmp_path, r"\) >= 0, 1\.0, tl\.where\(", ") > 0, 1.0, tl.where(")
    _assert_caught(clean, sabotaged, "atomic", "zeros")


def test_deterministic_reduction_halved(tmp_path, monkeypatch):
    clean = _load("kat_rational", tmp_path)
    assert all(r.ok for r in _run(clean, "deterministic", "normal"))
    backward = clean.module.backward

    def halved(dy, x, params, groups, deterministic=False):
        dx, dc = backward(dy, x, params, groups, deterministic)
        return dx, (dc * 0.5 if deterministic else dc)

    monkeypatch.setattr(clean.module, "backward", halved)
    assert not all(r.ok for r in _run(clean, "deterministic", "normal"))

    def broken(*args, **kwargs):
        raise ValueError("reduce kernel missing")

    monkeypatch.setattr(clean.module, "backward", broken)  # a form that raises fails its case, with the reason
    ((_, report),) = check_op(clean, only=lambda c: (c.form, c.draw, c.small) == ("deterministic", "normal", True))
    assert not any(r.ok for r in report) and "reduce kernel missing" in report.notes[0]


def test_clamped_basis_argument(tmp_path):
    clean = _load("cheby_kan", tmp_path)
    # u = tanh(x) clamped to tanh(4): only inputs beyond |x| = 4 change, where N(0, 1) draws almost never go
    sabotaged = _edited(clean, tmp_path, r"(def _arg\(xv\):\n(?:    #.*\n)?    return )(.*)\n",
                        r"\1tl.minimum(tl.maximum(\2, -0.99933), 0.99933)\n")
    _assert_caught(clean, sabotaged, "lut", "large")


def test_cu_seqlens_path_off_by_five_percent(tmp_path, monkeypatch):
    clean = _load("gka", tmp_path, kdim=16, vdim=12)
    assert all(r.ok for r in _run(clean, "cu_seqlens", "normal"))
    forward = clean.module.forward

    def packed_wrong(q, k, v, g, gk, beta, alpha, h_init, s_init, cu_seqlens, *rest):
        o, *others = forward(q, k, v, g, gk, beta, alpha, h_init, s_init, cu_seqlens, *rest)
        return (o * 1.05 if cu_seqlens is not None else o, *others)

    monkeypatch.setattr(clean.module, "forward", packed_wrong)
    assert not all(r.ok for r in _run(clean, "cu_seqlens", "normal"))


def test_every_case_is_listed_for_each_family(tmp_path):
    """The forms and draws the issue names are among the cases `ncd check` runs."""
    wanted = {
        "causal_gqa_spherical": {("streamed", "large"), ("streamed", "zeros"), ("streamed", "masked"),
                                 ("factorized", "normal"), ("factorized", "masked")},
        "group_rational": {("atomic", "zeros"), ("deterministic", "normal"), ("atomic", "large")},
        "cheby_kan": {("lut", "large"), ("recurrence", "normal"), ("lut", "zeros")},
    }
    for stem, pairs in wanted.items():
        cases = forms_for(_load(stem, tmp_path)).cases((torch.float32, torch.bfloat16))
        assert pairs <= {(c.form, c.draw) for c in cases}, stem
        assert any(c.dtype == torch.bfloat16 for c in cases)
    gka_op = _load("gka", tmp_path, kdim=16, vdim=12)
    gka = {(c.form, c.draw) for c in forms_for(gka_op).cases((torch.float32,))}
    assert {("chunk 16", "normal"), ("chunk 32", "gates"), ("cu_seqlens", "normal"), ("state", "normal")} <= gka
    # three or more chunks: the causal factorized form's queries, GKA's tokens at chunk 16
    attention = _load("causal_spherical_attention", tmp_path, dim=16)
    forms = forms_for(attention)
    case = Case("factorized", "normal", torch.float32, True)
    sizes = forms.sizes(case, forms.plan.validation_sizes(attention.front.program))
    assert sizes[forms.plan.roles.q_axes[2]] > 2 * attention.module.CHUNK
    forms = forms_for(gka_op)
    case = Case("chunk 16", "normal", torch.float32, True)
    sizes = forms.sizes(case, forms.plan.validation_sizes(gka_op.front.program))
    assert sizes[forms.plan.roles.time] > 2 * 16


def test_row_metric_sees_a_few_wrong_rows():
    from ncd.validate import ROW_FACTOR, _rel, row_error

    ref = torch.randn(200, 16, dtype=torch.float64)
    out = ref.clone()
    out[0] *= 1.05  # one token 5% off: 0.35% over the whole tensor
    assert _rel(out, ref) < 1e-2 < row_error(out, ref) / ROW_FACTOR
    tiny = ref.clone()
    tiny[1] *= 1e-6  # a tiny row is judged against the tensor's scale, not its own
    assert row_error(tiny + 1e-9, tiny) < 1e-6
    assert Case("a", "b", torch.bfloat16).dtype_name == "bfloat16"


def test_spec_outside_the_specialised_families_is_checked_by_the_generic_family(run_cli, tmp_path):
    for text in ("spec plain_gelu\naxis row\nin x[row] : f32\nout y[row] = x * sigmoid(1.702 * x)\n",
                 "spec norm_matmul\naxis row, d, e\nin x[row d] : f32\nparam W[d e] : f32\n"
                 "n[row] = sqrt(sum(x^2, over d) / size(d) + 0.00001)\nxn[row d] = x / n\n"
                 "out y[row e] = xn . W over d\n"):
        path = tmp_path / "unclaimed.ncd"
        path.write_text(text)
        code, out, err = run_cli("check", str(path))
        assert code == 0, (out, err)
        assert "ok   plan" in out and "(generic)" in out and "ok   numerics" in out


def test_empty_registry_is_a_located_error(run_cli, tmp_path, monkeypatch):
    """Were no family to claim a spec (the generic one declined or missing), `ncd check` fails at the output."""
    import ncd.families

    monkeypatch.setattr(ncd.families, "REGISTRY", ())
    text = "spec plain_gelu\naxis row\nin x[row] : f32\nout y[row] = x * sigmoid(1.702 * x)\n"
    path = tmp_path / "unclaimed.ncd"
    path.write_text(text)
    code, out, err = run_cli("check", str(path))
    assert code == 1, (out, err)
    assert f"{path}:4:1: error[no-kernel-family]: no kernel family claims spec" in err
    assert "ok   syntax" in out and "ok   numerics" not in out


def test_rational_draws_stay_off_the_kink_of_the_denominator(run_cli):
    """Seed 703677875 once put an element's |u| (|u| ~ 1e6 at x ~ 28) within fp32 rounding of u = 0: the kernel's
    fp32 sum landed on the other side of the kink than float64, d|u|/du flipped, and dB was 1.5e-4 off (PyTorch's
    own fp32 evaluation of the same draw: 3.6e-8), failing a correct kernel. Draws now move x off such kinks."""
    code, out, _ = run_cli("check", "--seed", "703677875", str(SPECS / "group_rational.ncd"))
    assert code == 0 and "FAIL" not in out and "atomic / large" in out


def _largest_score(op: Op, case: Case, seed: int) -> float:
    """The largest visible score of `ncd check`'s draw for `case` (as run_case draws it)."""
    from ncd.reference import evaluate

    target, inputs = case_inputs(forms_for(op), case, "cpu", torch.Generator().manual_seed(seed))
    found: list[torch.Tensor] = []
    evaluate(target.front.program, {n: v.float() for n, v in inputs.items()}, scores=found)
    return max(float(s.abs().max()) for s in found)


def test_attention_draws_aim_at_their_score_range(tmp_path):
    """The large draw reaches scores of a few hundred, never past LARGE_SCORE (float64's exp overflows at 709: at a
    unit temperature, x8 once gave thousands and an infinite reference); bf16 draws stay at practical scores (a
    unit temperature peaks near 40, where bf16 gradients of any implementation miss 1e-2). The plain softmax keeps
    its draws: x8 (its peak is under LARGE_SCORE; q's odd rows unscaled) and unscaled bf16."""
    from ncd.families.attention.forms import LARGE_FACTOR, LARGE_SCORE, LOW_PRECISION_SCORE

    large = Case("streamed", "large", torch.float32, True)
    low = Case("streamed", "normal", torch.bfloat16, True)
    temperature = _load("learned_temperature_softmax", tmp_path)
    peaks = []
    for seed in range(3):
        peak = _largest_score(temperature, large, seed)
        assert 88 < peak <= LARGE_SCORE * 1.01, (seed, peak)  # past fp32's exp overflow, inside float64's
        peaks.append(peak)
        peak = _largest_score(temperature, low, seed)
        assert peak <= LOW_PRECISION_SCORE * 1.05, (seed, peak)
    assert max(peaks) > 0.9 * LARGE_SCORE, peaks  # some draw needed the cap
    for form, draw, dtype in (("streamed", "large", torch.float32), ("streamed", "normal", torch.bfloat16)):
        rows = _run(temperature, form, draw, dtype)
        assert all(r.ok for r in rows), rows
    softmax = _load("softmax_attention", tmp_path)
    plain = forms_for(softmax)
    for case in (large, low):
        generator = torch.Generator().manual_seed(0)
        _, drawn = case_inputs(plain, case, "cpu", generator, drawn=False)
        again = plain.draw(case, dict(drawn), generator)
        factor = LARGE_FACTOR if case.draw == "large" else 1.0
        assert torch.equal(again["K"], drawn["K"] * factor)
        # q's even query rows scaled, the odd ones kept: rows of a saturated softmax have gradients of ~0, so some
        # rows must not saturate for the relative errors to mean anything
        assert torch.equal(again["Q"][:, :, 0::2], drawn["Q"][:, :, 0::2] * factor)
        assert torch.equal(again["Q"][:, :, 1::2], drawn["Q"][:, :, 1::2])


def test_fast_forgetting_gates_catch_an_unstable_gka_solve(tmp_path, monkeypatch):
    """bf16 inputs with gates logsigmoid(N(0, 1)): the states keep few keys, where one fp16 product per operand pair
    put GKA's tokens up to 100% off (kernel.py's solve_precision). `ncd check` passes the default split products and
    fails the same op when 16-bit inputs are given the single fp16 products."""
    from ncd.families.recurrence import kernel as kernels

    clean = _load("gka", tmp_path, kdim=16, vdim=12)
    assert all(r.ok for r in _run(clean, "chunk 16", "fast gates", torch.bfloat16))
    by_dtype = kernels.solve_precision
    monkeypatch.setattr(kernels, "solve_precision",
                        lambda config, dtype: "fp16" if dtype == torch.bfloat16 else by_dtype(config, dtype))
    assert not all(r.ok for r in _run(clean, "chunk 16", "fast gates", torch.bfloat16))


def test_a_gradient_that_cancels_is_judged_by_the_case_not_by_its_rounding(tmp_path):
    """FoX's fq gradient is zero in exact arithmetic (softmax ignores a shift of a row): float64 gives 1e-14 of
    rounding, the kernel 1e-6, once a relative error of 1e9 that failed every case. It is judged against the
    case's largest quantity: the kernel's rounding passes, a kernel that adds 1e-3 to each pair's share fails. A
    gradient that is small but not zero keeps its own norm."""
    from ncd.validate import CANCELS, _cancellation_scales

    clean = _load("forgetting_softmax", tmp_path)
    sabotaged = _edited(clean, tmp_path, r"(d\d+) = ds\n", r"\1 = ds + 0.001\n")  # fq's share (fk's is -ds)
    _assert_caught(clean, sabotaged, "streamed", "normal")
    small = torch.full((4,), 1e-6, dtype=torch.float64)
    assert _cancellation_scales((torch.ones(4), small, small * CANCELS)) == [None, None, 2.0]
