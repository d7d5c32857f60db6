"""ncd/launch.py: direct launches of compiled kernels after Triton's first launch at a specialisation. There is no
GPU here, so Triton's side is played by stand-ins that record what they are called with."""

from __future__ import annotations

import pytest
import torch

from ncd import launch


class Compiled:
    function, packed_metadata = "function", "packed"

    def __init__(self, calls):
        self.calls = calls

    def launch_metadata(self, *args):
        return "launch-metadata"

    def run(self, *args):
        self.calls.append(("direct", *args))


class Config:
    def __init__(self, calls):
        self.kwargs = {"BLOCK": 32}
        self.pre_hook = lambda nargs: calls.append(("hook", nargs["x"].shape, nargs["BLOCK"]))


class Tuned:
    """An autotuned kernel (x, n, BLOCK: constexpr tuned, MODE: constexpr given) as Triton presents it."""

    class fn:  # the JIT function an autotuner wraps
        arg_names = ("x", "n", "scale", "BLOCK", "MODE")

    def __init__(self):
        self.calls: list = []
        self.best_config = Config(self.calls)

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.calls.append(("triton", grid({**kwargs, **self.best_config.kwargs}), args, kwargs))
            return Compiled(self.calls)
        return run


@pytest.fixture
def gpu(monkeypatch):
    monkeypatch.setattr(launch, "_current_device", lambda: 0)
    monkeypatch.setattr(launch, "_current_stream", lambda device: 77)


def _grid(meta):
    return (100 // meta["BLOCK"] + 1,)


def test_second_call_launches_the_compiled_kernel_with_tritons_argument_order(gpu):
    kernel = Tuned()
    fast = launch.FastKernel(kernel, enabled=True)
    x = torch.zeros(3, 4)
    fast[_grid](x, 100, 0.5, MODE="a")
    assert kernel.calls == [("triton", (4,), (x, 100, 0.5), {"MODE": "a"})] and fast.why == "direct"
    y = torch.ones(3, 4)  # another tensor of the same dtype, device and alignment
    fast[_grid](y, 100, 0.25, MODE="a")
    runtime = launch._RUNTIME
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    meta = "launch-metadata" if enter is not None else None
    assert kernel.calls[1:] == [("hook", (3, 4), 32),
                                ("direct", 4, 1, 1, 77, "function", "packed", meta, enter, leave, y, 100, 0.25, 32,
                                 "a")]


@pytest.mark.parametrize("change", ["int", "constexpr", "dtype", "alignment"])
def test_anything_triton_specialises_on_goes_back_to_triton(gpu, change):
    kernel = Tuned()
    fast = launch.FastKernel(kernel, enabled=True)
    x = torch.zeros(64)
    fast[_grid](x, 100, 0.5, MODE="a")
    args, mode = [x, 100, 0.5], "a"
    if change == "int":
        args[1] = 96  # divisible by 16 now: Triton would compile another kernel
    elif change == "constexpr":
        mode = "b"
    elif change == "dtype":
        args[0] = x.double()
    else:
        args[0] = x[1:]  # 4 bytes past a 16-byte boundary
    fast[_grid](*args, MODE=mode)
    assert [c[0] for c in kernel.calls] == ["triton", "triton"]
    fast[_grid](*args, MODE=mode)
    assert kernel.calls[-1][0] == "direct"


def test_disabled_or_unusual_kernels_stay_on_tritons_path(gpu):
    kernel = Tuned()
    off = launch.FastKernel(kernel, enabled=False)
    for _ in range(2):
        off[_grid](torch.zeros(4), 100, 0.5, MODE="a")
    assert [c[0] for c in kernel.calls] == ["triton", "triton"]

    class Misordered(Tuned):
        class fn:
            arg_names = ("x", "BLOCK", "n", "scale", "MODE")  # a constexpr before a runtime argument

    kernel = Misordered()
    fast = launch.FastKernel(kernel, enabled=True)
    for _ in range(2):
        fast[_grid](torch.zeros(4), 100, 0.5, MODE="a")
    assert [c[0] for c in kernel.calls] == ["triton", "triton"]
    assert "constexprs" in fast.why


def test_on_by_default_except_in_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not launch.FastKernel(Tuned()).enabled
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert launch.FastKernel(Tuned()).enabled
    monkeypatch.setenv("NCD_FAST_LAUNCH", "0")
    assert not launch.FastKernel(Tuned()).enabled


class Jit:
    """A @triton.jit kernel (a, b, C1: constexpr, C2: constexpr) as Triton presents it; `fail_above` stages raise
    Triton's OutOfResources."""

    arg_names = ("a", "b", "C1", "C2")

    @staticmethod
    def fn(a, b, C1, C2):  # a JIT function's `fn`: the plain Python function, which has no arg_names
        pass

    def __init__(self, fail_above=None):
        self.calls: list = []
        self.fail_above = fail_above

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.calls.append(("triton", grid, args, kwargs))
            if self.fail_above is not None and kwargs["num_stages"] > self.fail_above:
                raise type("OutOfResources", (Exception,), {})("shared memory")
            return Compiled(self.calls)
        return run


def test_bound_kernel_launches_directly_with_the_constexprs_in_signature_order():
    kernel = Jit()
    bound = launch.BoundKernel(kernel, (2, 3), {"C2": "x", "C1": 1}, num_warps=4, num_stages=2, enabled=True)
    bound(77, "A", "B")
    assert kernel.calls == [("triton", (2, 3, 1), ("A", "B"), {"C2": "x", "C1": 1, "num_warps": 4, "num_stages": 2})]
    assert bound.why == "direct"
    bound(78, "A2", "B2")
    runtime = launch._RUNTIME
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    meta = "launch-metadata" if enter is not None else None
    assert kernel.calls[1] == ("direct", 2, 3, 1, 78, "function", "packed", meta, enter, leave, "A2", "B2", 1, "x")


def test_bound_kernel_steps_down_pipeline_stages_on_out_of_resources():
    kernel = Jit(fail_above=1)
    bound = launch.BoundKernel(kernel, (4,), {"C1": 1, "C2": "x"}, num_stages=3, enabled=True)
    bound(0, "A", "B")
    assert [c[3]["num_stages"] for c in kernel.calls] == [3, 2, 1] and bound.options["num_stages"] == 1
    with pytest.raises(Exception, match="shared memory"):  # nothing left to step down: Triton's error
        launch.BoundKernel(Jit(fail_above=0), (4,), {"C1": 1, "C2": "x"}, num_stages=1, enabled=True)(0, "A", "B")


def test_bound_kernel_stays_on_tritons_path_when_disabled():
    kernel = Jit()
    bound = launch.BoundKernel(kernel, (4,), {"C1": 1, "C2": "x"}, enabled=False)
    for _ in range(2):
        bound(0, "A", "B")
    assert [c[0] for c in kernel.calls] == ["triton", "triton"] and bound.why == "disabled"


def test_plain_jit_kernel_launches_directly_with_its_constexprs_and_keyed_options(gpu):
    kernel = Jit()
    fast = launch.FastKernel(kernel, enabled=True)
    for warps in (4, 4, 8):
        fast[(5,)]("A", "B", C2="x", C1=1, num_warps=warps)
    assert [c[0] for c in kernel.calls] == ["triton", "direct", "triton"]
    assert kernel.calls[1][-4:] == ("A", "B", 1, "x")  # every parameter, in signature order, no options


def _hook_a(x):
    return x


def _hook_b(x):
    return x + 1


def _hook_c(x):
    return x * 2


def test_hooks_are_keyed_by_identity_not_by_their_source_hash(monkeypatch):
    """A @triton.jit hook's own hash hashes its source key (about 0.5 us); a launch passes up to 14 of them."""
    from triton.runtime.jit import JITFunction

    from ncd.launch import _kwargs_key

    hooks = [JITFunction(f) for f in (_hook_a, _hook_b, _hook_c)]  # compiled-mode objects (the suite interprets)

    def refuse(self):
        raise AssertionError("a hook was hashed by its source key")

    monkeypatch.setattr(JITFunction, "__hash__", refuse)
    key = _kwargs_key({"A1": hooks[0], "A2": hooks[1], "B": hooks[2], "CAUSAL": True, "num_warps": 4})
    assert hash(key) == hash(_kwargs_key({"A1": hooks[0], "A2": hooks[1], "B": hooks[2], "CAUSAL": True,
                                          "num_warps": 4}))
    assert key != _kwargs_key({"A1": hooks[1], "A2": hooks[1], "B": hooks[2], "CAUSAL": True, "num_warps": 4})
