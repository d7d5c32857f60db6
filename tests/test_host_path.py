"""The host-time shortcuts of the shared op runtime keep its behaviour (issue 31; bench/host_cpu.py times them):
launchers found through `resolver` follow a replaced module launcher (a sabotaged kernel still reaches the op),
call-time checks remembered per signature (`CheckMemo`) never remember a failure and are redone for another
shape, dtype or device, and the direct launcher's keys tell apart what Triton specialises on."""

from __future__ import annotations

import pytest
import torch

import ncd
import ncd.runtime as rt
from ncd.errors import CallError
from ncd.launch import _key_of, _kwargs_key
from ncd.op_runtime import late, resolver

from .conftest import ROOT

KAT_SPEC = ROOT / "specs" / "kat_rational.ncd"


def test_resolver_follows_a_replaced_late_launcher():
    namespace = {"forward": lambda x: x + 1}
    launcher = late(namespace, "forward")
    now = resolver(launcher)
    assert now()(1) == 2 and launcher(1) == 2
    namespace["forward"] = lambda x: -x  # what tests and `ncd check` do to a generated module
    assert now()(1) == -1 and launcher(1) == -1

    def plain(x):
        return 3 * x

    assert resolver(plain)() is plain


def test_replaced_module_launcher_reaches_every_call_of_the_op(op_cache, monkeypatch):
    op = ncd.load(KAT_SPEC, op_cache)
    x, a, b = torch.randn(5, 24), torch.randn(6), torch.randn(8, 4)
    first = op(x, a, b)  # checks done and remembered: the next calls take the short path
    assert torch.equal(op(x, a, b), first)
    monkeypatch.setattr(op.module, "forward", lambda x, params, groups: torch.full_like(x, 7.0))
    assert torch.equal(op(x, a, b), torch.full_like(x, 7.0))
    xg = x.clone().requires_grad_()
    assert torch.equal(op(xg, a, b), torch.full_like(x, 7.0))  # the autograd path too


def test_remembered_checks_skip_only_signatures_that_passed(op_cache, monkeypatch):
    op = ncd.load(KAT_SPEC, op_cache)
    checks = []
    bind_axes = rt.bind_axes
    monkeypatch.setattr(rt, "bind_axes", lambda *args: checks.append(1) or bind_axes(*args))
    a, b = torch.randn(6), torch.randn(8, 4)
    for _ in range(3):  # sizes no other test of this (shared, cached) op uses (test_rational's include 7 x 40)
        op(torch.randn(11, 56), a, b)
    assert len(checks) == 1
    op(torch.randn(13, 56), a, b)  # another shape: checked
    op(torch.randn(13, 56), a.clone(), b.clone())  # other tensors, the same signature: not checked again
    assert len(checks) == 2
    for _ in range(2):  # a failure is never remembered: every bad call raises, naming the tensor and the axis
        with pytest.raises(CallError, match=r"x: axis 'chan' \(30\) is not a multiple of group \(8\)"):
            op(torch.randn(5, 30), a, b)
    with pytest.raises(CallError, match=r"B has dtype torch\.int64"):
        op(torch.randn(5, 24), a, torch.ones(8, 4, dtype=torch.long))
    with pytest.raises(CallError, match="meta tensor"):  # same shapes and dtypes as a passed call, another device
        op(torch.randn(11, 56, device="meta"), a, b)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # a passed CPU signature holds only under the interpreter
    with pytest.raises(CallError, match="is on the CPU"):
        op(torch.randn(11, 56), a, b)


def test_check_memo_signature_and_limit():
    x = torch.zeros(2, 3)
    assert rt.CheckMemo.signature(x, None) == ((x.shape, x.dtype, x.device), None)
    assert rt.CheckMemo.signature(x, 1.0) is None  # not a tensor: nothing remembered, the checks name it
    assert rt.CheckMemo.signature(x) != rt.CheckMemo.signature(x.double())
    assert rt.CheckMemo.signature(x) != rt.CheckMemo.signature(x.t())
    memo = rt.CheckMemo(limit=2)
    memo.put(None, 1)
    assert memo.entries == {} and memo.get(None) is None
    for n in range(3):
        memo.put(rt.CheckMemo.signature(torch.zeros(n)), n)
    assert len(memo.entries) == 1 and memo.get(rt.CheckMemo.signature(torch.zeros(2))) == 2


def test_launch_keys_of_tuples_and_parameters():
    ints = (3, 1, 16)
    assert _key_of(ints) == (tuple, ints)
    assert _key_of(((1,), (4, 1))) == (tuple, ((tuple, (1,)), (tuple, (4, 1))))
    assert _key_of((4, 1)) != _key_of((4, 2))  # Triton specialises ints by value
    t = torch.zeros(4)
    param = torch.nn.Parameter(torch.zeros(4))
    assert _key_of(param) == _key_of(t) == (torch.float32, -1, True)
    assert _key_of((t, 3)) == (tuple, (_key_of(t), 3))
    assert _key_of((t, object())) is NotImplemented and _key_of((object(),)) is NotImplemented
    assert _key_of(t[1:]) != _key_of(t)  # 16-byte alignment is part of the key


def test_kwargs_key_tells_names_from_values():
    assert _kwargs_key({"A": 1, "B": 2}) != _kwargs_key({"B": 1, "A": 2})
    assert _kwargs_key({"A": 1, "B": 2}) == _kwargs_key({"A": 1, "B": 2})
    assert _kwargs_key({"A": 1, "num_warps": 4}) != _kwargs_key({"A": 1, "num_warps": 8})
