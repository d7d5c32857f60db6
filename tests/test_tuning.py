"""Autotuning kept on disk (ncd/tuning.py): decisions survive the process, are keyed by device, kernel, hooks and
tuning key, are never trusted beyond naming one of the given configs, and benchmarking shows progress on stderr.
No GPU here: the autotuner is driven with an injected benchmark (a stand-in kernel that records its launches, and
one real @triton.jit kernel in the interpreter), with the interpreter switch and the device identity patched."""

from __future__ import annotations

import io
import json
import os
import sys
import warnings

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

import ncd.tuning as tuning

from .conftest import ROOT

DEVICE_A = {"name": "Test GPU A", "capability": "9.0", "triton": triton.__version__, "cuda": "12.8"}
DEVICE_B = {"name": "Test GPU B", "capability": "9.0", "triton": triton.__version__, "cuda": "12.8"}
TIMES = {16: 3.0, 32: 1.0, 64: 2.0}  # ms by BLOCK: 32 is the best


def _kernel_body(x, N, HOOK, BLOCK):  # the stand-in kernel's signature
    pass


class StandInKernel:
    """What the autotuner needs of a JIT function: its parameter names, `fn`, and `run` (recording launches)."""

    def __init__(self) -> None:
        self.arg_names = ["x", "N", "HOOK", "BLOCK"]
        self.fn = _kernel_body
        self.launches: list[int] = []

    def run(self, *args, **kwargs):
        self.launches.append(kwargs["BLOCK"])


def hook_one(x):
    return x + 1


def hook_two(x):
    return x + 2


HOOK_ONE, HOOK_TWO = JITFunction(hook_one), JITFunction(hook_two)


class Bench:
    """An injected do_bench: runs the config once (so the stand-in records it) and returns its table time."""

    def __init__(self, kernel: StandInKernel) -> None:
        self.kernel, self.measured = kernel, []

    def __call__(self, kernel_call, quantiles):
        kernel_call()
        block = self.kernel.launches[-1]
        self.measured.append(block)
        return [TIMES[block]] * 3


def configs():
    return [triton.Config({"BLOCK": b}, num_warps=w) for b, w in ((16, 1), (32, 2), (64, 4))]


def process(prune=None):
    """A fresh autotuner over a fresh stand-in kernel: what a new process builds."""
    kernel = StandInKernel()
    bench = Bench(kernel)
    options = {"prune_configs_by": {"early_config_prune": prune}} if prune else {}
    tuner = tuning.autotune(configs(), key=["N"], name="tests.stand_in", do_bench=bench, **options)(kernel)
    return tuner, kernel, bench


def call(tuner, n=37, dtype=torch.float32, hook=HOOK_ONE):
    tuner.run(torch.zeros(3, dtype=dtype), n, HOOK=hook)


@pytest.fixture
def device(monkeypatch, tmp_path):
    """Compiled mode on a pretend device, a private cache directory; returns a setter for the device."""
    current = dict(DEVICE_A)
    monkeypatch.setenv("NCD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("NCD_TUNE_CACHE", raising=False)
    monkeypatch.setattr(tuning, "interpreting", lambda: False)
    monkeypatch.setattr(tuning, "device_identity", lambda: current)
    monkeypatch.setitem(sys.modules, "tqdm", None)  # plain progress lines whether or not tqdm is installed

    def use(identity):
        current.clear()
        current.update(identity)

    return use


def tuning_dir(tmp_path):
    return tmp_path / "cache" / "tuning"


def stored(tmp_path, identity=DEVICE_A):
    return json.loads((tuning_dir(tmp_path) / tuning._file_name(identity)).read_text())


def test_first_process_benchmarks_and_keeps_it_later_process_reads_it(device, tmp_path, capsys):
    tuner, kernel, bench = process()
    call(tuner)
    assert sorted(bench.measured) == [16, 32, 64]
    assert kernel.launches[-1] == 32
    data = stored(tmp_path)
    assert data["device"] == DEVICE_A
    (entry,) = data["entries"].values()
    assert entry["config"]["kwargs"] == {"BLOCK": 32} and entry["config"]["num_warps"] == 2
    assert entry["ms"] == TIMES[32] and entry["configs"] == 3
    assert sorted(entry["timings"].values()) == sorted(TIMES[b] for b in (16, 32, 64))  # every config's time
    assert os.stat(tuning_dir(tmp_path)).st_mode & 0o777 == 0o700

    assert "ncd: tuned" in capsys.readouterr().err

    tuner, kernel, bench = process()  # a new process: no benchmark, the kept config runs
    call(tuner)
    assert bench.measured == []
    assert kernel.launches == [32]
    assert tuning.EVENTS[-1].source == "disk" and tuning.EVENTS[-1].config.startswith("BLOCK=32")
    assert capsys.readouterr().err == ""  # nothing to wait for, nothing said


def test_key_holds_tuning_values_dtypes_and_hooks(device, tmp_path):
    tuner, _, _ = process()
    call(tuner)
    for change in ({"n": 38}, {"dtype": torch.float16}, {"hook": HOOK_TWO}):
        tuner, _, bench = process()
        call(tuner, **change)
        assert sorted(bench.measured) == [16, 32, 64], change
    assert len(stored(tmp_path)["entries"]) == 4


def test_key_includes_the_device(device, tmp_path):
    tuner, _, _ = process()
    call(tuner)
    device(DEVICE_B)
    tuner, _, bench = process()
    call(tuner)
    assert sorted(bench.measured) == [16, 32, 64]
    assert stored(tmp_path, DEVICE_B)["device"] == DEVICE_B
    device(DEVICE_A)
    tuner, _, bench = process()
    call(tuner)
    assert bench.measured == []


def _rewrite_entries(tmp_path, change):
    path = tuning_dir(tmp_path) / tuning._file_name(DEVICE_A)
    data = json.loads(path.read_text())
    for entry in data["entries"].values():
        change(entry)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("damage", ["garbage", "not json object", "other device", "entry not a dict",
                                    "unknown config", "config as text"])
def test_damaged_or_foreign_file_is_ignored_and_rewritten(device, tmp_path, damage):
    tuner, _, _ = process()
    call(tuner)
    path = tuning_dir(tmp_path) / tuning._file_name(DEVICE_A)
    if damage == "garbage":
        path.write_bytes(b"\x00\xff{{{ not json")
    elif damage == "not json object":
        path.write_text("[1, 2, 3]")
    elif damage == "other device":
        data = json.loads(path.read_text())
        data["device"] = DEVICE_B
        path.write_text(json.dumps(data))
    elif damage == "entry not a dict":
        data = json.loads(path.read_text())
        data["entries"] = {k: "BLOCK=16" for k in data["entries"]}
        path.write_text(json.dumps(data))
    elif damage == "unknown config":  # a planted decision for a config the kernel was not given
        _rewrite_entries(tmp_path, lambda e: e["config"]["kwargs"].update(BLOCK=999))
    else:
        _rewrite_entries(tmp_path, lambda e: e.update(config="__import__('os').system('false')"))
    tuner, kernel, bench = process()
    call(tuner)
    assert sorted(bench.measured) == [16, 32, 64]
    assert 999 not in kernel.launches and kernel.launches[-1] == 32
    (entry,) = stored(tmp_path)["entries"].values()  # rewritten whole, with the fresh decision
    assert entry["config"]["kwargs"] == {"BLOCK": 32}


def test_kept_config_runs_with_its_pre_hook(device):
    """The config object the kernel was given runs, pre_hook included (the attention configs set TMA tiles)."""
    hooked = []

    def process_with_hooks():
        kernel = StandInKernel()
        hooked_configs = [triton.Config({"BLOCK": b}, pre_hook=lambda args, b=b: hooked.append(b)) for b in TIMES]
        tuner = tuning.autotune(hooked_configs, key=["N"], name="tests.hooked", do_bench=Bench(kernel))(kernel)
        return tuner, kernel

    tuner, _ = process_with_hooks()
    call(tuner)
    hooked.clear()
    tuner, kernel = process_with_hooks()
    call(tuner)
    assert kernel.launches == [32] and hooked == [32]


def test_kept_config_pruned_at_this_call_is_not_used(device, tmp_path):
    tuner, _, _ = process()
    call(tuner)
    tuner, kernel, bench = process(prune=lambda cs, nargs, **kw: [c for c in cs if c.kwargs["BLOCK"] != 32])
    call(tuner)
    assert sorted(bench.measured) == [16, 64]
    assert 32 not in kernel.launches


def test_group_writable_directory_is_refused(device, tmp_path):
    tuning_dir(tmp_path).mkdir(parents=True, mode=0o700)
    os.chmod(tuning_dir(tmp_path), 0o770)
    tuner, _, bench = process()
    with pytest.warns(RuntimeWarning, match="writable by group"):
        call(tuner)
    assert sorted(bench.measured) == [16, 32, 64]
    tuner, _, bench = process()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per process
        call(tuner)
    assert sorted(bench.measured) == [16, 32, 64]  # nothing was kept
    assert list(tuning_dir(tmp_path).iterdir()) == []


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(tuning, "_WARNED", set())


def test_planted_link_is_not_followed(device, tmp_path):
    tuner, _, _ = process()
    call(tuner)
    path = tuning_dir(tmp_path) / tuning._file_name(DEVICE_A)
    target = tmp_path / "elsewhere.json"
    os.replace(path, target)
    before = target.read_text()
    path.symlink_to(target)
    tuner, _, bench = process()
    call(tuner)
    assert sorted(bench.measured) == [16, 32, 64]  # the linked decision was not read
    assert not path.is_symlink() and target.read_text() == before  # the link replaced, its target untouched


def test_progress_and_summary_on_stderr(device, capsys):
    tuner, _, _ = process()
    call(tuner)
    err = capsys.readouterr().err.splitlines()
    steps = [line for line in err if ": config " in line]
    assert [line.split(": config ")[1].split(" ")[0] for line in steps] == ["1/3", "2/3", "3/3"]
    assert all(line.startswith("ncd: tuning tests.stand_in._kernel_body for key (N=37, float32)") for line in steps)
    (summary,) = [line for line in err if line.startswith("ncd: tuned")]
    assert "BLOCK=32, num_warps=2" in summary and "best of 3" in summary and " s: " in summary
    assert "kept in" in summary


def test_progress_redraws_one_line_on_a_terminal(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    stream = Terminal()
    progress = tuning.Progress("k for key (N=3)", 2, stream)
    for config in configs()[:2]:
        progress.step(config)
    progress.close("ncd: tuned k")
    text = stream.getvalue()
    assert text.count("\r") == 3 and text.count("\n") == 1 and text.endswith("ncd: tuned k\n")
    assert "config 2/2" in text


def test_switched_off_by_setting(device, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NCD_TUNE_CACHE", "0")
    for _ in range(2):
        tuner, _, bench = process()
        call(tuner)
        assert sorted(bench.measured) == [16, 32, 64]
    assert not tuning_dir(tmp_path).exists()
    assert "config 3/3" in capsys.readouterr().err  # progress still shown


def test_interpreter_is_passed_through(device, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tuning, "interpreting", lambda: True)
    tuner, kernel, _ = process()
    call(tuner)
    assert kernel.launches[-1] == 32  # Triton's own autotuner, unchanged
    assert not tuning_dir(tmp_path).exists()
    assert capsys.readouterr().err == ""


def test_lone_kept_config_is_not_measured_again(device):
    """Triton 3.6 benchmarks a single pruned config; the kept one answers without running."""
    tuner, kernel, bench = process()
    chosen = tuner.configs[1]
    tuner._restored = chosen
    tuner.nargs = {}
    assert tuner._bench(torch.zeros(1), 5, config=chosen, HOOK=HOOK_ONE) == [0.0, 0.0, 0.0]
    assert bench.measured == [] and kernel.launches == []


@triton.jit
def add_one_kernel(x, y, N, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < N
    tl.store(y + offsets, tl.load(x + offsets, mask=mask) + 1, mask=mask)


def test_real_triton_kernel(device, tmp_path):
    """A @triton.jit kernel (interpreted) through Triton's autotuner and launch path, in two 'processes'."""
    measured = []

    def bench(kernel_call, quantiles):
        kernel_call()
        measured.append(1)
        return [float(len(measured) % 3 + 1)] * 3  # the third config is the fastest

    for expect in (3, 0):
        kernel = tuning.autotune(configs(), key=["N"], name="tests.add_one", do_bench=bench)(add_one_kernel)
        x = torch.randn(37)
        y = torch.full_like(x, float("nan"))
        kernel[lambda meta: (triton.cdiv(37, meta["BLOCK"]),)](x, y, 37)
        assert torch.equal(y, x + 1)
        assert kernel.best_config.kwargs == {"BLOCK": 64}
        assert len(measured) == expect
        measured.clear()
    (entry,) = stored(tmp_path)["entries"].values()
    assert entry["kernel"] == "tests.add_one.add_one_kernel"


# --- ncd tune ---------------------------------------------------------------------------------------------------

SPEC = str(ROOT / "specs" / "gelu.ncd")


def test_tune_without_cuda_exits_2(run_cli, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, err = run_cli("tune", SPEC, "--shape", "row=64")
    assert code == 2 and out == ""
    assert "ncd tune needs a CUDA GPU" in err and "Traceback" not in err


def test_tune_under_interpreter_exits_2(run_cli, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    code, _, err = run_cli("tune", SPEC)
    assert code == 2 and "TRITON_INTERPRET=1" in err


def test_tune_bad_shape_exits_2(run_cli):
    code, _, err = run_cli("tune", SPEC, "--shape", "row=zero")
    assert code == 2 and "--shape takes AXIS=SIZE" in err


def test_tune_spec_runs_the_op_at_the_given_sizes(monkeypatch):
    """What `ncd tune` does after its GPU check, run on the CPU (the generic family's eager op)."""
    out = io.StringIO()
    events = tuning.tune_spec(SPEC, ["row=3", "dim=5"], "fp32", True, device="cpu", out=out)
    text = out.getvalue()
    assert events == []
    assert "gelu at row=3, dim=5 (fp32)" in text and "forward" in text and "backward" in text
    with pytest.raises(tuning.TuneError, match="no axis batch; its axes are row, dim"):
        tuning.tune_spec(SPEC, ["batch=3"], "fp32", device="cpu", out=out)


# --- on the GPU (`pytest -m gpu`) ---------------------------------------------------------------------------------

_GPU = [pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU host)"),
        pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiled kernels only: run "
                           "`pytest -m gpu`, which leaves Triton's interpreter off")]


@_GPU[0]
@_GPU[1]
@_GPU[2]
def test_gpu_decision_survives_the_process(tmp_path, monkeypatch):
    """The compiled kernel through the installed Triton's autotuner and its real benchmark: a fresh autotuner finds
    the first one's decision on disk and measures nothing (Triton 3.6 included, which benchmarks a lone config)."""
    monkeypatch.setenv("NCD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tuning, "_WARNED", set())
    measured = []

    def bench(kernel_call, quantiles):
        measured.append(1)
        return triton.testing.do_bench(kernel_call, warmup=1, rep=3, quantiles=quantiles)

    x = torch.randn(1000, device="cuda")
    for expect_measured in (True, False):
        measured.clear()
        kernel = tuning.autotune(configs(), key=["N"], name="tests.gpu_add_one", do_bench=bench)(add_one_kernel)
        y = torch.full_like(x, float("nan"))
        kernel[lambda meta: (triton.cdiv(1000, meta["BLOCK"]),)](x, y, 1000)
        assert torch.equal(y, x + 1)
        assert (len(measured) == 3) if expect_measured else measured == []
    data = json.loads(next((tmp_path / "tuning").glob("*.json")).read_text())
    assert data["device"]["name"] == torch.cuda.get_device_name()


@_GPU[0]
@_GPU[1]
@_GPU[2]
def test_gpu_ncd_tune_then_a_new_process_finds_it(tmp_path):
    """`ncd tune` twice, as two processes: the second finds every decision on disk. Needs the kernels on
    ncd.tuning.autotune (the rational family's kernels are autotuned over several tiles)."""
    import subprocess

    env = {**os.environ, "NCD_CACHE_DIR": str(tmp_path), "TRITON_INTERPRET": "0"}
    command = [sys.executable, "-m", "ncd.cli", "tune", str(ROOT / "specs" / "group_rational.ncd"),
               "--shape", "row=1000", "--shape", "width=64", "--dtype", "fp32"]
    first = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr
    assert "tuned in" in first.stdout and "ncd: tuned" in first.stderr
    second = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr
    assert "found on disk" in second.stdout and "tuned in" not in second.stdout and "ncd: tuning" not in second.stderr
