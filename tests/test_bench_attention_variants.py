"""bench/attention_variants.py's formulas (the GPU bench of issue 32's attention variants against FlexAttention):
each variant's mask_mod/score_mod, as the dense formula, is the math of its shipped spec (ncd's float64 reference
evaluator); as FlexAttention's mods (eager, CPU, forward) it gives the dense formula's output; and ncd's op is
called with the spec's other inputs by name. The variants added in issue 32's second session (sinks, value head
dim, Q/K prologues, T5 table) also run the bench's correctness check on ncd's op (Triton's interpreter, tiny)."""

from __future__ import annotations

import importlib
import sys
from types import SimpleNamespace

import pytest
import torch

from .conftest import ROOT


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "bench"))  # the script imports bench/attention.py from beside itself
    try:
        yield importlib.import_module("attention_variants")
    finally:
        sys.path.remove(str(ROOT / "bench"))


def _names():
    # the variant names without importing the bench at collection time
    text = (ROOT / "bench" / "attention_variants.py").read_text()
    return [line.split('Variant("')[1].split('"')[0] for line in text.splitlines() if 'Variant("' in line]


@pytest.mark.parametrize("name", _names())
def test_formula_is_the_spec(bench, name):
    """The bench's formula against ncd.reference of the spec (window 8, 8 documents, N 37): a spec edited without
    the bench (or the reverse) fails here, before any GPU time is spent on a baseline of other math."""
    variant = bench.VARIANTS[name]
    assert (bench.SPEC_DIR / variant.spec).exists()
    assert bench.spec_agreement(variant) == ""


def test_formula_disagreement_is_caught(bench):
    """The agreement check can fail: the sliding window's formula given the causal spec."""
    wrong = bench.Variant("wrong", "causal_softmax_attention.ncd", mask=bench.sliding_window, inputs=bench.window_input)
    assert "differs" in bench.spec_agreement(wrong)


def test_sink_formula_disagreement_is_caught(bench):
    """A sink that the spec does not have (softmax-plus-one's formula given plain softmax) is caught too."""
    wrong = bench.Variant("wrong", "softmax_attention.ncd", sink=bench.plus_one)
    assert "differs" in bench.spec_agreement(wrong)


# the variants that are not softmax: their baseline is torch.compile of the formula, not FlexAttention
NOT_SOFTMAX = ("sliding_window_spherical", "alibi_sigmoid")
# issue 32, second session: one more sum entry (sink), v narrower than q and k, Q/K prologues, an indexed table
NEW = ("sink", "plus_one", "mla", "qk_norm", "cosine", "t5_bias", "feature_map")


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("name", [n for n in _names() if n not in NOT_SOFTMAX])
def test_flex_mods_give_the_dense_formula(bench, name):
    """FlexAttention's form of the variant (eager, CPU, fp32, forward: its mods and BlockMask, the Q/K prologue in
    PyTorch before it, a sink as O * sigmoid(lse - sink) after it) equals the dense formula: the same functions run
    under Flex's vmap (0-d indices) and on the dense formula's broadcast indices alike."""
    from torch.nn.attention.flex_attention import flex_attention

    variant = bench.VARIANTS[name]
    assert variant.softmax
    shape = bench.Shape(3, 2, 45, 6, "cpu")
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(shape.batch, shape.heads, shape.n, dim, generator=gen)
               for dim in (variant.dim, variant.dim, variant.dim_v))
    ex = variant.inputs(shape, gen)
    ref = bench.dense(variant, q, k, v, ex)
    assert ref.shape[-1] == variant.dim_v
    score_mod = bench.flex_mods(variant, ex)[0]
    with torch.no_grad():
        out = bench.flex_form(variant, ex, score_mod, bench.block_mask(variant, ex, shape), flex_attention)(q, k, v)
    assert bench.rel_err(out, ref) < 1e-5


def test_flex_sink_epilogue_uses_natural_log(bench):
    """Flex's lse is log Z in base e, as the epilogue O * sigmoid(lse - sink) needs (its kernels keep base 2 and the
    frontend rescales; torch issue 181645 was a backend that did not): against torch.logsumexp of the scores."""
    from torch.nn.attention.flex_attention import flex_attention

    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 3, 40, 16, generator=gen) for _ in range(3))
    with torch.no_grad():
        _, lse = bench.flex_lse(flex_attention, q, k, v, scale=0.25)
    assert torch.allclose(lse, torch.logsumexp(0.25 * q @ k.transpose(-1, -2), -1), atol=1e-5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("name", NEW)
def test_new_variant_check_runs_ncd(bench, name, monkeypatch):
    """The bench's correctness stage on the CPU at B 1, H 2, N 24: the spec loads (at the bench's head dims), the
    dense formula is the spec's, ncd's op takes the bench's inputs by name and returns the output and a gradient
    for Q, K, V and every parameter (the sink logit, QK-norm's gains, the temperature, the T5 table), close to the
    fp32 formula (a bound that a wrong formula or a dropped term breaks; the GPU run checks the issue's 1e-2),
    and Flex's form of it (fp32) equals the formula."""
    monkeypatch.setattr(bench, "ON_GPU", False)  # set from sys.argv at import: pytest's has no --cpu
    variant, shape = bench.VARIANTS[name], bench.Shape(1, 2, 24, 4, "cpu")
    loaded = bench.load(variant, lambda line: None)
    assert loaded.op is not None, loaded.error
    c = bench.check(variant, loaded, shape, lambda line: None)
    assert c.ran and c.agreement == "OK", (c.agreement, c.note)
    params = bench.params(variant.inputs(shape, torch.Generator()))
    assert set(c.errors) == {"o", "dq", "dk", "dv", *(f"d{p}" for p in params)}, c.note
    assert all(e < 3e-2 for e in c.errors.values()), c.errors
    assert c.flex.startswith("o=") and float(c.flex.split("=")[1].split()[0]) < 1e-5, c.flex


def test_ncd_kwargs(bench):
    """Q, K, V positional, the rest by the spec's names; a scalar at its default's value left out; a name the op
    does not take, or an input the bench has no value for, is an error naming it."""
    def const(value):
        return bench.ncd.ir.Const(value, span=None)

    def arg(name, role="in", default=None):
        return SimpleNamespace(name=name, role=role, default=default)

    def fn(Q, K, V, *, window=None, scale=None, slope=None):
        return None

    op = SimpleNamespace(name="x", fn=fn, signature=(arg("Q"), arg("K"), arg("V"), arg("window", default=const(256.0)),
                                                       arg("scale", default=const(0.5)), arg("slope", "param")))
    slope = torch.ones(2)
    assert bench.ncd_kwargs(op, {"window": 256, "slope": slope}) == {"slope": slope}
    assert bench.ncd_kwargs(op, {"window": 16, "slope": slope}) == {"window": 16, "slope": slope}
    with pytest.raises(KeyError, match="slope"):
        bench.ncd_kwargs(op, {"window": 16})

    def narrow(Q, K, V, scale=None):
        return None

    op.fn = narrow
    with pytest.raises(TypeError, match="takes no slope"):
        bench.ncd_kwargs(op, {"slope": slope})
