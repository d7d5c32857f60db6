"""Lint generated module text with the project's ruff configuration (issue 31: generated code is ruff-clean).

`lint_generated(code, name)` pipes `code` into `ruff check --stdin-filename NAME.py -` and returns one line per
finding, `NAME.py:LINE:COL: CODE message`, in ruff's order; an empty list means clean.

Which configuration: ruff always runs `--isolated` (no configuration file is discovered, so the answer does not
depend on the working directory) with the `[tool.ruff]` table passed as `--config KEY=VALUE` overrides. That table
is read from the source checkout's pyproject.toml when the package runs from one (editable install, CI), else
from `RUFF_SETTINGS`, a copy that ships in the wheel; tests/test_generated_lint.py fails when the copy and
pyproject.toml differ. ruff runs in an empty temporary directory with `ncd` declared first-party, as it is when
ruff checks the repository (its `src` is the repo root, where `ncd/` lives), so import sorting (I001) is judged
the same from a checkout and from an installed wheel.

ruff is a test dependency (`pip install -e .[test]`), not a run-time one: `RuffMissing` says how to get it.

`python -m ncd.lint SPEC... [-v]` renders each spec and prints its findings counted by rule (-v: every finding).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

# pyproject.toml's [tool.ruff] table, for installs without the source checkout; keep in step (a test compares)
RUFF_SETTINGS: dict[str, Any] = {
    "line-length": 120,
    "target-version": "py310",
    "lint": {
        "select": ["E", "F", "W", "I", "B", "UP", "SIM", "RUF"],
        "ignore": ["E731", "RUF001", "RUF002", "RUF003", "UP007"],
    },
}
FIRST_PARTY = ("ncd",)


class RuffMissing(RuntimeError):
    pass


def repo_pyproject() -> Path | None:
    """The source checkout's pyproject.toml when this package runs from one, else None."""
    candidate = Path(__file__).resolve().parent.parent / "pyproject.toml"
    if candidate.is_file() and '\nname = "ncd"' in candidate.read_text(encoding="utf-8"):
        return candidate
    return None


def ruff_settings() -> dict[str, Any]:
    """The `[tool.ruff]` table: the checkout's pyproject.toml if there is one, else the shipped copy."""
    path = repo_pyproject()
    if path is None or sys.version_info < (3, 11):
        return RUFF_SETTINGS
    import tomllib

    table: dict[str, Any] = tomllib.loads(path.read_text(encoding="utf-8")).get("tool", {}).get("ruff", {})
    return table


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot pass {value!r} to ruff as TOML")


def config_overrides(table: Mapping[str, Any], prefix: str = "") -> list[str]:
    """`--config` arguments (`lint.select = [...]`) that set every leaf of a `[tool.ruff]` table."""
    args = []
    for key, value in table.items():
        dotted = f"{prefix}{json.dumps(key) if '.' in key else key}"
        if isinstance(value, Mapping) and not key.endswith("per-file-ignores"):  # those tables are values
            args.extend(config_overrides(value, dotted + "."))
        else:
            args.extend(["--config", f"{dotted} = {_toml_value(value)}"])
    return args


def ruff_command() -> list[str]:
    try:
        from ruff.__main__ import find_ruff_bin

        return [os.fsdecode(find_ruff_bin())]
    except (ImportError, FileNotFoundError):
        found = shutil.which("ruff")
        if found is None:
            raise RuffMissing("ruff is not installed: `pip install ruff` (it comes with `pip install -e .[test]`)"
                              ) from None
        return [found]


def lint_generated(code: str, name: str) -> list[str]:
    """ruff's findings on generated module text `code`, checked as `name`.py: `NAME.py:LINE:COL: CODE message`."""
    settings = ruff_settings()
    overrides = config_overrides(settings)
    if "known-first-party" not in settings.get("lint", {}).get("isort", {}):
        overrides += ["--config", f"lint.isort.known-first-party = {_toml_value(list(FIRST_PARTY))}"]
    filename = f"{name}.py"
    with tempfile.TemporaryDirectory(prefix="ncd-lint-") as empty:
        done = subprocess.run([*ruff_command(), "check", "--isolated", "--no-cache", *overrides,
                               "--output-format", "json", "--stdin-filename", filename, "-"],
                              input=code, capture_output=True, text=True, cwd=empty, check=False)
    if done.returncode not in (0, 1):
        raise RuntimeError(f"ruff failed (exit {done.returncode}): {done.stderr.strip()}")
    findings = json.loads(done.stdout or "[]")
    return [f"{filename}:{f['location']['row']}:{f['location']['column']}: {f['code'] or 'syntax'} {f['message']}"
            for f in findings]


def count_by_rule(findings: Iterable[str]) -> Counter[str]:
    """Findings per rule code (`E501`: 12), from `lint_generated`'s lines."""
    return Counter(line.split(": ", 1)[1].split(" ", 1)[0] for line in findings)


def main(argv: list[str] | None = None) -> int:
    """Render each spec, lint its module, print counts by rule per spec and in total; exit 1 on any finding."""
    from ncd.backend import generate
    from ncd.errors import NcdError
    from ncd.pipeline import load_spec

    parser = argparse.ArgumentParser(prog="python -m ncd.lint", description=main.__doc__)
    parser.add_argument("specs", nargs="+", help=".ncd files")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every finding, not only counts")
    args = parser.parse_args(argv)

    def by_rule(counts: Counter[str]) -> str:
        return ", ".join(f"{rule} {n}" for rule, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))

    total: Counter[str] = Counter()
    failed = False
    for spec in args.specs:
        try:
            code = generate(load_spec(spec))
        except NcdError as err:
            print(f"{spec}: no module ({str(err).splitlines()[0]})")
            failed = True
            continue
        except Exception as err:  # a compiler bug (or a template mid-edit): report it, lint the other specs
            print(f"{spec}: rendering failed: {type(err).__name__}: {err}")
            failed = True
            continue
        findings = lint_generated(code, Path(spec).stem)
        counts = count_by_rule(findings)
        total += counts
        failed |= bool(findings)
        print(f"{spec}: {len(findings)} findings in {len(code.splitlines())} lines"
              + (f": {by_rule(counts)}" if counts else ""))
        if args.verbose:
            print("".join(f"    {line}\n" for line in findings), end="")
    print(f"total: {sum(total.values())} findings" + (f": {by_rule(total)}" if total else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
