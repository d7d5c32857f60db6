"""bench/attention_variants.py's formulas (the GPU bench of issue 32's attention variants against FlexAttention):
each variant's mask_mod/score_mod, as the dense formula, is the math of its shipped spec (ncd's float64 reference
evaluator); as FlexAttention's mods (eager, CPU, forward) it gives the dense formula's output; and ncd's op is
called with the spec's other inputs by name. No kernels run here: the GPU run checks those."""

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


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("name", [n for n in _names() if n not in ("sliding_window_spherical", "alibi_sigmoid")])
def test_flex_mods_give_the_dense_formula(bench, name):
    """FlexAttention (eager, CPU, fp32, forward) with the variant's mods and BlockMask equals the dense formula: the
    same functions run under Flex's vmap (0-d indices) and on the dense formula's broadcast indices alike."""
    from torch.nn.attention.flex_attention import flex_attention

    variant = bench.VARIANTS[name]
    assert variant.softmax
    shape = bench.Shape(3, 2, 45, 6, "cpu")
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(shape.batch, shape.heads, shape.n, bench.DIM, generator=gen) for _ in range(3))
    ex = variant.inputs(shape, gen)
    ref = bench.dense(variant, q, k, v, ex)
    score_mod = bench.flex_mods(variant, ex)[0]
    with torch.no_grad():
        out = flex_attention(q, k, v, score_mod=score_mod, block_mask=bench.block_mask(variant, ex, shape),
                             scale=variant.scale)
    assert bench.rel_err(out, ref) < 1e-5


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
