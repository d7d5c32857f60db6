from __future__ import annotations

import os
import tempfile
from pathlib import Path

# Generated modules from CLI runs go to a throw-away cache, not the user's ~/.cache/ncd.
os.environ.setdefault("NCD_CACHE_DIR", tempfile.mkdtemp(prefix="ncd-test-cache-"))
# Every kernel's output and workspace buffers start as NaN (ncd.settings.poison_outputs): an element a kernel
# forgets to store fails the test that reads it.
os.environ.setdefault("NCD_POISON_OUTPUTS", "1")

import pytest

ROOT = Path(__file__).resolve().parent.parent


def pytest_configure(config):
    """No GPU on CI: generated kernels run in Triton's CPU interpreter, chosen before Triton is imported (test
    modules import it at collection, after this hook). `pytest -m gpu` on the GPU host compiles them instead: the
    GPU tests exist to catch what the interpreter cannot (shared memory, real tensor-core precisions)."""
    os.environ.setdefault("TRITON_INTERPRET", "0" if config.getoption("markexpr") == "gpu" else "1")


SPECS = sorted((ROOT / "specs").glob("*.ncd"))


def raise_float_errors():
    """numpy's floating-point errors raised: the interpreter computes in numpy, and no generated kernel may form
    0 / 0, divide by zero or overflow, not even in padding that is never stored (the attention forward once divided
    such rows by b(0), and `ncd check` printed numpy's warning)."""
    import numpy as np

    return np.errstate(divide="raise", invalid="raise", over="raise")


@pytest.fixture
def run_cli(capsys):
    """Run `ncd ARGS...` in-process; returns (exit code, stdout, stderr)."""
    from ncd.cli import main

    def run(*args: str) -> tuple[int, str, str]:
        if args[:1] == ("check",) and "--seed" not in args:  # reproducible draws; NCD_TEST_SEED picks others
            args = ("check", "--seed", os.environ.get("NCD_TEST_SEED", "20261126"), *args[1:])
        try:
            code = main(list(args))
        except SystemExit as exit_:  # argparse usage errors
            code = int(exit_.code or 0)
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


@pytest.fixture(autouse=True)
def _seeded_global_rng(request):
    """torch's global RNG seeded per test, from its id and NCD_TEST_SEED (which picks other draws): what a test
    draws without a generator of its own (`validate(op)`) no longer depends on which tests ran before it in its
    process, which xdist decides anew at every run (a serial run once drew an ALiBi slope no parallel run had)."""
    import zlib

    import torch

    torch.manual_seed(zlib.crc32(f"{os.environ.get('NCD_TEST_SEED', '20261126')}:{request.node.nodeid}".encode()))


@pytest.fixture(scope="session")
def op_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("ncd_cache")


def with_alpha(chunk, **fixed):
    """A GKA `chunk` taking the drawn (q, k, v, g, beta, alpha) positionally: alpha goes by keyword, after fla's
    positional (q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)."""
    def call(q, k, v, g, beta, alpha, **kwargs):
        return chunk(q, k, v, g, beta, alpha=alpha, **fixed, **kwargs)
    return call
