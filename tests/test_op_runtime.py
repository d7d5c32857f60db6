"""The op runtime (ncd/op_runtime) tested directly on a toy kernel pair written in PyTorch: y = x * w + b (b an
optional tensor, `shift` a float constant), with a saved-only statistic. The custom ops' schemas and fakes
(opcheck), the eager path and the torch.compile path against autograd of the same formula, gradients only where
asked, the Module, call-time errors that name the tensor and the axis, and distinct ops for distinct op ids."""

from __future__ import annotations

import itertools

import pytest
import torch

import ncd.runtime as rt
from ncd.errors import CallError
from ncd.op_runtime import Arg, KernelOp, op_module

_IDS = itertools.count()
_AXES = {"row": (None, ()), "chan": (None, ())}


def _toy(calls: list[str] | None = None) -> KernelOp:
    """x [row chan] * w [chan] + b [chan] (b optional) + shift; saves the row norms of x (a statistic)."""
    log = calls if calls is not None else []

    def forward(x, w, b, shift):
        log.append("forward")
        return _reference(x, w, b, shift), x.norm(dim=1)

    def eager_forward(needs, x, w, b, shift):
        log.append(f"eager_forward{tuple(needs)}")
        return (_reference(x, w, b, shift), x.norm(dim=1)), "stash"

    def fake(x, w, b, shift):
        return torch.empty_like(x), x.new_empty(x.shape[0])

    def backward(grads, saved, constants, needs, stash):
        log.append(f"backward stash={stash}")
        (dy,) = grads
        x, w, _, norm = saved
        assert torch.allclose(norm, x.norm(dim=1))
        return [dy * w if needs[0] else None, (dy * x).sum(0) if needs[1] else None,
                dy.sum(0) if needs[2] else None]

    return KernelOp(f"ncd::toy_{next(_IDS)}", "toy", [Arg("x", grad=True), Arg("w", grad=True),
                                                      Arg("b", "Tensor?", grad=True), Arg("shift", "float")],
                    ["y", "norm"], forward=forward, fake=fake, backward=backward, eager_forward=eager_forward,
                    save_results=[1])


def _inputs(with_b=True):
    x, w, b = torch.randn(7, 5), torch.randn(5), torch.randn(5)
    return [t.requires_grad_() for t in (x, w, b)] if with_b else [x.requires_grad_(), w.requires_grad_(), None]


def _reference(x, w, b, shift):
    y = x * w + shift
    return y + b if b is not None else y


def test_eager_path_runs_launchers_only_and_matches_autograd():
    calls: list[str] = []
    op = _toy(calls)
    x, w, b = _inputs()
    y, norm = op(x, w, b, 0.5)
    assert not norm.requires_grad  # a statistic: no gradient
    grads = torch.autograd.grad((y * torch.linspace(-1, 1, 5)).sum(), (x, w, b))
    want = torch.autograd.grad((_reference(x, w, b, 0.5) * torch.linspace(-1, 1, 5)).sum(), (x, w, b))
    for got, ref in zip(grads, want, strict=True):
        torch.testing.assert_close(got, ref)
    assert calls == ["eager_forward(True, True, True, False)", "backward stash=stash"]


def test_gradients_only_where_asked_and_none_for_absent_optional():
    calls: list[str] = []
    op = _toy(calls)
    x, w, _ = _inputs(with_b=False)
    w.requires_grad_(False)
    y, _ = op(x, w, None, 0.0)
    (dx,) = torch.autograd.grad(y.sum(), (x,))
    torch.testing.assert_close(dx, w.expand(7, 5))
    assert calls[0] == "eager_forward(True, False, False, False)"


def test_no_grad_calls_skip_autograd():
    calls: list[str] = []
    op = _toy(calls)
    with torch.no_grad():
        y, _ = op(*_inputs(), 1.0)
    assert y.grad_fn is None and calls == ["eager_forward(False, False, False, False)"]


def test_double_backward_create_graph_names_the_op():
    op = _toy()
    x, w, b = _inputs()
    y, _ = op(x, w, b, 0.0)
    with pytest.raises(RuntimeError, match="toy: double backward"):
        torch.autograd.grad(y.sum(), (x,), create_graph=True)


def test_custom_ops_pass_opcheck_and_compile_traces_them():
    calls: list[str] = []
    op = _toy(calls)
    x, w, b = (t.detach() for t in _inputs())
    torch.library.opcheck(op.forward_op, (x, w, b, 0.25), test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(op.forward_op, (x, w, None, 0.25), test_utils=("test_schema", "test_faketensor"))
    saved = [x, w, b, x.norm(dim=1)]
    for needs in ([True, True, True, False], [True, False, False, False]):
        torch.library.opcheck(op.backward_op, ([torch.randn(7, 5)], saved, 0.25, needs),
                              test_utils=("test_schema", "test_faketensor"))
    leaves = _inputs()
    compiled, _ = torch.compile(lambda *a: op(*a), fullgraph=True, backend="aot_eager")(*leaves, 0.25)
    want = _reference(*leaves, 0.25)
    torch.testing.assert_close(compiled, want)
    got = torch.autograd.grad((compiled * torch.linspace(-1, 1, 5)).sum(), leaves)
    ref = torch.autograd.grad((want * torch.linspace(-1, 1, 5)).sum(), leaves)
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g, r)
    # the compiled graph calls the custom ops, whose backward gets no stash; the eager forward never ran
    assert "backward stash=None" in calls and not any(c.startswith("eager") for c in calls)


def test_distinct_op_ids_give_distinct_custom_ops():
    first, second = _toy(), _toy()
    assert first.forward_op is not second.forward_op
    assert first.qualname != second.qualname
    with pytest.raises(ValueError, match="ncd::"):
        KernelOp("toy", "toy", [Arg("x")], ["y"], forward=lambda x: (x,), fake=lambda x: (x,),
                 backward=lambda *a: (None,))


def test_module_wraps_the_function():
    op = _toy()

    def toy(x, w, b, shift=0.0):
        return op(x, w, b, shift)[0]

    module = op_module(toy, "toy as a module")()
    x, w, b = _inputs()
    torch.testing.assert_close(module(x, w, b, 2.0), _reference(x, w, b, 2.0))
    assert type(module).__module__ == __name__ and type(module).__doc__ == "toy as a module"


def test_call_time_errors_name_the_tensor_and_axis():
    x, w, _ = (t.detach() for t in _inputs())
    tensors = [("x", x, ("row", "chan")), ("w", w[:4], ("chan",))]
    with pytest.raises(CallError, match=r"w: axis 'chan' has size 4, but x has 5"):
        rt.bind_axes(_AXES, tensors)
    with pytest.raises(CallError, match=r"x must have 2 dims \[row chan\]"):
        rt.bind_axes(_AXES, [("x", x[0], ("row", "chan"))])
    with pytest.raises(CallError, match=r"w has dtype torch\.int64"):
        rt.check_floats([("x", x), ("w", w.long())])


def test_bad_argument_descriptions_are_refused():
    with pytest.raises(ValueError, match="only tensors take gradients"):
        Arg("s", "float", grad=True)
    with pytest.raises(ValueError, match="type must be one of"):
        Arg("s", "double")
    with pytest.raises(ValueError, match="may not be named"):
        KernelOp("ncd::toy_clash", "toy", [Arg("x"), Arg("needs", "bool")], ["y"], forward=lambda x, n: (x,),
                 fake=lambda x, n: (x,), backward=lambda *a: (None,))


PLANNER = ("ncd.families.attention.plan", "ncd.families.polykan.plan", "ncd.families.rational.plan",
           "ncd.families.recurrence.plan", "ncd.backend")


def test_the_runtime_loads_no_planner_module():
    """Generated modules import the runtime: loading it must not pull in the compiler's planners."""
    import subprocess
    import sys

    code = ("import sys; import ncd.families.attention.runtime, ncd.families.recurrence.runtime, "
            "ncd.families.polykan.runtime, ncd.families.rational.runtime; "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('ncd'))))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert "ncd.families.recurrence.runtime" in loaded
    assert not [m for m in loaded if m in PLANNER], loaded


def test_op_templates_import_only_the_runtime():
    """Every import line of the op templates names a runtime, ncd.errors, kernels or math, never a planner."""
    import re
    from importlib import resources

    allowed = re.compile(r"(import|from) (ncd\.op_runtime|ncd\.families\.\w+\.(runtime|kernel\w*)|ncd\.runtime|"
                         r"ncd\.errors|math)\b")
    for family in ("attention", "recurrence", "polykan", "rational"):
        text = resources.files("ncd.templates").joinpath(f"{family}_op.py.jinja").read_text()
        imports = [line for line in text.splitlines() if line.startswith(("import ", "from "))]
        assert imports, family
        for line in imports:
            assert allowed.match(line), f"{family}_op.py.jinja: {line}"
