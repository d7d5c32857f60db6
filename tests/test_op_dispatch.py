"""The two call paths of the KAN-family ops: torch.compile(fullgraph=True) traces their torch.library custom ops
(fake tensors, registered autograd), eager calls run the kernels' autograd.Function without the custom ops'
dispatch. Both must give the same output and gradients. (The attention and GKA ops have their own such tests.)"""

from __future__ import annotations

import pytest
import torch

import ncd
import ncd.families.polykan.plan
from ncd.op_runtime import REGISTERED

from .conftest import ROOT


def _rational(cache):
    op = ncd.load(ROOT / "specs" / "kat_rational.ncd", cache_dir=cache)
    groups = op.module._AXES["group"][0] or 8
    return op, [torch.randn(39, groups * 5), torch.randn(6), torch.randn(groups, 4)]


def _polykan(cache):
    op = ncd.families.polykan.plan.basis_op("chebyshev", 5, "lut", cache_dir=cache)
    return op, [torch.randn(11, 7), torch.randn(7, 9, 6) / 6]


@pytest.mark.parametrize("make", [_rational, _polykan], ids=["rational", "polykan"])
def test_compiled_and_eager_calls_agree_and_eager_skips_the_custom_ops(op_cache, monkeypatch, make):
    op, inputs = make(op_cache)  # outputs start as NaN: NCD_POISON_OUTPUTS (tests/conftest.py)
    leaves = [t.requires_grad_() for t in inputs]
    compiled = torch.compile(op.fn, fullgraph=True, backend="aot_eager")(*leaves)
    compiled_grads = torch.autograd.grad((compiled * torch.linspace(-1, 1, compiled.shape[-1])).sum(), leaves)
    ident = op.module.__name__.removeprefix("ncd_generated_")
    kernel_ops = [k for name, k in REGISTERED.items() if name == f"ncd::{ident}"]
    assert len(kernel_ops) == 1, sorted(REGISTERED)

    def no_dispatch(*args, **kwargs):
        raise AssertionError("an eager call dispatched through a custom op")
    for name in ("forward_op", "backward_op"):
        monkeypatch.setattr(kernel_ops[0], name, no_dispatch)
    eager = op(*leaves)
    torch.testing.assert_close(eager, compiled)
    grads = torch.autograd.grad((eager * torch.linspace(-1, 1, eager.shape[-1])).sum(), leaves)
    for got, want in zip(grads, compiled_grads, strict=True):
        assert not got.isnan().any()
        torch.testing.assert_close(got, want)
    with torch.no_grad():
        torch.testing.assert_close(op(*inputs), compiled.detach())
