from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SPECS = sorted((ROOT / "specs").glob("*.ncd"))


@pytest.fixture
def run_cli(capsys):
    """Run `ncd ARGS...` in-process; returns (exit code, stdout, stderr)."""
    from ncd.cli import main

    def run(*args: str) -> tuple[int, str, str]:
        try:
            code = main(list(args))
        except SystemExit as exit_:  # argparse usage errors
            code = int(exit_.code or 0)
        out = capsys.readouterr()
        return code, out.out, out.err

    return run
