"""A family's config is what tests and benchmarks change (`Op.with_config`, `compile_spec(..., config=...)`), never
the generated module's globals: an override is another op (its own op id, cached like any op) whose plan has
`dataclasses.replace(plan.config, **fields)`; a field the family's config lacks is a clear error."""

from __future__ import annotations

import pytest
import torch

import ncd
from ncd import settings
from ncd.compiler import ConfigError, compile_spec
from ncd.families.polykan.plan import basis_op
from ncd.reference import evaluate
from ncd.settings import poisoned

from .conftest import SPECS


def _spec(stem):
    return next(p for p in SPECS if p.stem == stem)


@pytest.fixture
def spherical(op_cache):
    """Causal spherical attention at head dim 16: it has both forms, streamed and factorized."""
    return ncd.load(_spec("causal_spherical_attention"), cache_dir=op_cache, sizes={"dim": 16})


def _qkv(n=37, m=37, d=16):
    torch.manual_seed(0)
    return [torch.randn(1, 2, size, d, requires_grad=True) for size in (n, m, m)]


def test_each_form_is_its_own_op_and_both_match_float64(spherical, monkeypatch):
    always, never = spherical.with_config(factorize="always"), spherical.with_config(factorize="never")
    ids = {spherical.compiled.op_id, always.compiled.op_id, never.compiled.op_id}
    assert len(ids) == 3 and always.module is not spherical.module
    assert (always.config.factorize, never.config.factorize, spherical.config.factorize) == ("always", "never", "auto")
    assert "factorize='always'" in always.path.read_text() and "factorize=" not in spherical.path.read_text()
    calls = {"factorized": 0}
    run = always.module.forward_factorized

    def counted(*args, **kwargs):
        calls["factorized"] += 1
        return run(*args, **kwargs)

    monkeypatch.setattr(always.module, "forward_factorized", counted)  # a spy: the op reads its module's launchers
    q, k, v = _qkv()
    grad = torch.randn(1, 2, 37, 16)
    leaves = {n: t.detach().double().requires_grad_() for n, t in zip("QKV", (q, k, v), strict=True)}
    ref = evaluate(spherical.front.program, leaves)["O"]
    ref_grads = torch.autograd.grad(ref, list(leaves.values()), grad.double())
    for op, factorized in ((always, 1), (never, 0)):
        calls["factorized"] = 0
        out = op(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), grad)
        assert calls["factorized"] == factorized
        for got, want in ((out, ref), *zip(grads, ref_grads, strict=True)):
            assert ((got.double() - want).norm() / want.norm()).item() < 1e-4


def test_the_same_override_is_the_same_op_and_overrides_add_up(spherical, op_cache):
    a = spherical.with_config(use_tma=False)
    assert a.module is spherical.with_config(use_tma=False).module  # cached under its op id
    both = a.with_config(factorize="never")
    assert both.compiled.config == (("factorize", "never"), ("use_tma", False))
    assert (both.config.use_tma, both.config.factorize) == (False, "never")
    again = compile_spec(_spec("causal_spherical_attention"), {"dim": 16}, cache_dir=op_cache,
                         config={"factorize": "never", "use_tma": False})
    assert again.op_id == both.compiled.op_id and again.module is both.module
    planned = compile_spec(_spec("causal_spherical_attention"), {"dim": 16}, until="plan",
                           config={"factorize": "never", "chunk": 32})
    assert "form per call: never" in "\n".join(planned.plan.describe())  # --emit plan prints the config
    assert "chunks of 32 keys" in "\n".join(planned.plan.describe())


def test_unknown_fields_and_bad_values_are_clear_errors(spherical):
    with pytest.raises(ConfigError, match=r"AttentionConfig \(the attention family's config\) has no field "
                                          r"'factorise'; its fields are .*use_tma.*factorize"):
        spherical.with_config(factorise="always")
    with pytest.raises(ConfigError, match="factorize must be one of auto, always, never, not 'sometimes'"):
        spherical.with_config(factorize="sometimes")
    with pytest.raises(ConfigError, match=r"AttentionConfig.use_tma is a bool \(True\), not 0"):
        spherical.with_config(use_tma=0)
    with pytest.raises(ConfigError, match="chunk must be None"):
        spherical.with_config(chunk=48)
    with pytest.raises(ConfigError, match=r"RationalConfig .* has no field 'regime'"):
        compile_spec(_spec("kat_rational"), until="plan", config={"regime": "gemm"})
    with pytest.raises(ConfigError, match="the generic family has no config to override"):
        compile_spec(_spec("rmsnorm_matmul"), until="plan", config={"use_tma": False})


def test_rational_accumulation_default_is_the_configs(op_cache, monkeypatch):
    op = ncd.load(_spec("kat_rational"), cache_dir=op_cache)
    deterministic = op.with_config(accumulate="deterministic")
    assert deterministic.config.accumulate == "deterministic" and op.config.accumulate == "atomic"
    seen = []
    for variant in (op, deterministic):
        backward = variant.module.backward

        def spy(dy, x, params, groups, det=False, _backward=backward):
            seen.append(det)
            return _backward(dy, x, params, groups, det)

        monkeypatch.setattr(variant.module, "backward", spy)
    torch.manual_seed(0)
    inputs = [torch.randn(_shape(op, t), requires_grad=True) for t in op.signature]
    for variant in (op, deterministic):
        out = variant(*inputs)
        grads = torch.autograd.grad(out.square().sum(), inputs)
        assert all(torch.isfinite(g).all() for g in grads)
    assert seen == [False, True]  # a call without the keyword takes the config's accumulation


def _shape(op, tensor):
    sizes = {**op.plan.validation_sizes(op.front.program), op.plan.roles.row: 7}  # a few odd rows
    return tuple(sizes[a] for a in tensor.axes)


def test_polykan_regime_is_the_configs(op_cache):
    op = basis_op("chebyshev", 5, "recurrence", cache_dir=op_cache)
    gemm = op.with_config(regime="gemm")
    assert "launch choices fixed by the config (not per size): regime gemm" in "\n".join(gemm.plan.describe())
    torch.manual_seed(0)
    x, c = torch.randn(13, 11), torch.randn(11, 7, 6) / 6
    torch.testing.assert_close(gemm(x, c), op(x, c), rtol=1e-4, atol=1e-5)
    regimes = {p.til.regime for p in gemm.module._PLANS.values()} | {p.til.regime for p in op.module._PLANS.values()}
    assert [p.til.regime for p in gemm.module._PLANS.values()] == ["gemm"] and regimes == {"gemm", "fused"}


def test_poisoned_switches_the_nan_fill_for_a_block(spherical):
    new = spherical.module.KERNELS.new
    with poisoned():
        assert torch.isnan(new((3, 5), torch.float32, torch.device("cpu"))).all()
        with poisoned(False):
            assert not settings.POISON_OUTPUTS
        assert settings.POISON_OUTPUTS


def test_recurrence_config_overrides_reach_the_module(op_cache):
    op = ncd.load(_spec("gka"), cache_dir=op_cache, sizes={"kdim": 16, "vdim": 12})
    ieee = op.with_config(dot_precision="ieee", chunk=32)
    assert ieee.compiled.op_id != op.compiled.op_id
    assert (ieee.module.CONFIG.dot_precision, ieee.module.CONFIG.chunk, ieee.module.CHUNK) == ("ieee", 32, 32)
    assert op.module.CONFIG.chunk == 64
    with pytest.raises(ConfigError, match="chunk must be 16, 32, 64 or 128, not 48"):
        op.with_config(chunk=48)
