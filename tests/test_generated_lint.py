"""Every shipped spec's generated module passes the project's ruff configuration (issue 31, item 7).

The module is rendered in-process (`ncd.backend.generate`, what `ncd compile SPEC` prints) and piped into ruff by
`ncd.lint.lint_generated` with pyproject.toml's [tool.ruff] settings. A spec that renders no module fails too:
every shipped spec must compile. Every finding of some specs, counted by rule: `python -m ncd.lint specs/*.ncd -v`.
"""

from __future__ import annotations

import sys

import pytest

from ncd.lint import RUFF_SETTINGS, config_overrides, count_by_rule, lint_generated, repo_pyproject, ruff_settings

from .conftest import SPECS


def _render(spec) -> str:
    import ncd.backend
    import ncd.pipeline
    from ncd.errors import NcdError

    try:
        return ncd.backend.generate(ncd.pipeline.load_spec(spec))
    except NcdError as err:
        pytest.fail(f"specs/{spec.name} renders no module, so there is nothing to lint: {err.render()}")


@pytest.mark.parametrize("spec", SPECS, ids=[s.stem for s in SPECS])
def test_generated_module_is_ruff_clean(spec):
    findings = lint_generated(_render(spec), spec.stem)
    counts = ", ".join(f"{rule} {n}" for rule, n in count_by_rule(findings).most_common())
    shown = "\n".join(findings[:60]) + (f"\n... {len(findings) - 60} more" if len(findings) > 60 else "")
    assert not findings, f"the module generated from specs/{spec.name} has {len(findings)} ruff findings " \
                         f"({counts}):\n{shown}"


def test_lint_finds_what_ruff_finds_and_passes_clean_code():
    dirty = ("import os\nimport torch\nimport ncd\n\n\ndef f(l):\n    unused = 1\n    return l\n\n\n"
             "x = 1  \n# " + "#" * 130 + "\n")
    rules = count_by_rule(lint_generated(dirty, "dirty"))
    # I001: ncd is first-party (its own block), as when ruff checks the repository; E501 at 120 columns
    assert {"F401", "I001", "E741", "F841", "E501", "W291"} <= set(rules), rules
    clean = '"""A module."""\n\nimport torch\n\nimport ncd\n\nVALUE = (torch, ncd)\n'
    assert lint_generated(clean, "clean") == []


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib reads pyproject.toml from Python 3.11")
def test_shipped_ruff_settings_match_pyproject():
    """Installed without the checkout, lint_generated uses ncd.lint.RUFF_SETTINGS: it must be pyproject's table."""
    assert repo_pyproject() is not None, "tests run from the source checkout, next to pyproject.toml"
    assert ruff_settings() == RUFF_SETTINGS, "ncd/lint.py's RUFF_SETTINGS differs from [tool.ruff] in pyproject.toml"


def test_config_overrides_pass_nested_tables_to_ruff(monkeypatch):
    table = {"line-length": 100, "lint": {"select": ["E"], "per-file-ignores": {"gen.py": ["E501"]},
                                          "isort": {"known-first-party": ["ncd"]}}}
    assert config_overrides(table) == [
        "--config", "line-length = 100", "--config", 'lint.select = ["E"]',
        "--config", 'lint.per-file-ignores = {"gen.py" = ["E501"]}',
        "--config", 'lint.isort.known-first-party = ["ncd"]']
    monkeypatch.setattr("ncd.lint.ruff_settings", lambda: table)
    long_line = "x = " + "1 + " * 30 + "1\n"  # 125 columns: over 100, ignored in gen.py only
    assert lint_generated(long_line, "gen") == []
    assert [line.split(": ")[1].split()[0] for line in lint_generated(long_line, "other")] == ["E501"]
