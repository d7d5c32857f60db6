"""The L1 / shared-memory split given to kernels that spill (families/recurrence/carveout.py), without a GPU: the
arithmetic, and which kernels reach the driver, through a stand-in driver."""

from types import SimpleNamespace

import pytest

from ncd.families.recurrence import carveout

H100_SHARED = 233472  # bytes of shared memory per SM at the largest carveout (228 KB)


@pytest.mark.parametrize(("shared", "regs", "warps", "percent"), [
    (49408, 255, 4, 44),  # the GKA solve: 2 programs by registers -> 2 x 50.4 KB, not 228 KB
    (65536, 255, 8, 29),  # one 8-warp program
    (98304, 255, 4, 86),  # two 97 KB programs: shared memory, not registers, is what limits
    (100000, 64, 4, 87),  # registers would allow 8: shared memory holds 2
])
def test_carveout_holds_as_many_programs_as_registers_allow(shared, regs, warps, percent):
    assert carveout.carveout_percent(shared, regs, warps, H100_SHARED) == percent


class FakeDriver:
    def __init__(self):
        self.calls = []

    def cuFuncSetCacheConfig(self, function, config):
        self.calls.append(("cache", function.value, config.value))

    def cuFuncSetAttribute(self, function, attribute, value):
        self.calls.append(("attribute", function.value, attribute.value, value.value))


def kernel(handle, shared=49408, spills=94, backend="cuda"):
    target = SimpleNamespace(backend=backend)
    return SimpleNamespace(function=handle, n_spills=spills, n_regs=255,
                           metadata=SimpleNamespace(shared=shared, num_warps=4, target=target))


@pytest.fixture
def driver(monkeypatch):
    fake = FakeDriver()
    monkeypatch.setattr(carveout, "_driver", lambda: fake)
    monkeypatch.setattr(carveout, "_device_limits", lambda device: (H100_SHARED, 65536, 2048))
    monkeypatch.setattr(carveout, "_fitted", set())
    import torch

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return fake


def test_a_spilling_kernel_gets_its_carveout_once(driver):
    k = kernel(0x1234)
    assert carveout.fit_carveout(k) is k
    carveout.fit_carveout(k)
    assert driver.calls == [("cache", 0x1234, 0), ("attribute", 0x1234, 9, 44)]


@pytest.mark.parametrize("k", [
    kernel(0x10, spills=0),  # registers suffice: nothing misses L1
    kernel(0x11, shared=40960),  # Triton leaves the carveout to the driver under 48 KB
    kernel(0x12, backend="hip"),
    kernel(None),  # the interpreter has no function handle
    None,  # nor a compiled kernel
])
def test_other_kernels_are_left_alone(driver, k):
    assert carveout.fit_carveout(k) is k
    assert driver.calls == []


def test_the_setting_turns_it_off(driver, monkeypatch):
    monkeypatch.setenv("NCD_FIT_CARVEOUT", "0")
    carveout.fit_carveout(kernel(0x20))
    assert driver.calls == []
