"""Golden files pin what the compiler emits: `ncd compile SPEC --emit ir` and `--emit plan` of every shipped spec.

tests/golden/NAME.ir and tests/golden/NAME.plan hold the CLI's standard output for specs/NAME.ncd. Where a stage
fails (a spec no kernel family claims stops at `--emit plan`), the golden file holds a first line
`# exit N (stderr follows)` and the CLI's error text instead, so a spec that changes from error to plan, or
whose error changes, shows up in the diff.

After a deliberate change to the IR, a family's plan or the shipped specs (a new spec needs one too), rewrite
the golden files and review the diff before committing:

    NCD_UPDATE_GOLDEN=1 python -m pytest -q tests/test_golden.py

Machine independence: NCD_* settings, which may change plans, are cleared for the run (NCD_CACHE_DIR aside), so
the goldens pin the defaults; the spec's absolute path is written as `specs/NAME.ncd`; op ids (`NAME_` + 24 hex
digits) and 64-digit hex digests, which hash the compiler's own sources, become `NAME_<op-id>` and `<digest>`
(today's `--emit plan` prints neither). The plan's cost estimates are analytic (a fixed H100 model), not
measured, so they do not depend on the machine.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from .conftest import ROOT, SPECS

GOLDEN = Path(__file__).resolve().parent / "golden"
UPDATE = os.environ.get("NCD_UPDATE_GOLDEN", "").strip().lower() not in ("", "0", "false", "no", "off")
STAGES = ("ir", "plan")
# NCD_* settings (ncd/settings.py) may change plans; the goldens pin the defaults. The cache stays where it is.
_KEPT_SETTINGS = ("NCD_CACHE_DIR", "NCD_UPDATE_GOLDEN")
_OP_ID = re.compile(r"\b([A-Za-z_][A-Za-z0-9_]*?)_[0-9a-f]{24}\b")
_DIGEST = re.compile(r"\b[0-9a-f]{64}\b")


def normalise(text: str, spec: Path) -> str:
    """The CLI's text with what depends on the machine or on the compiler's own source digest replaced."""
    for path in (str(spec), str(spec.resolve())):
        text = text.replace(path, f"specs/{spec.name}")
    text = text.replace(str(ROOT) + os.sep, "")
    text = _DIGEST.sub("<digest>", text)
    return _OP_ID.sub(r"\1_<op-id>", text)


def emitted(run_cli, spec: Path, stage: str) -> str:
    code, out, err = run_cli("compile", str(spec), "--emit", stage)
    text = out if code == 0 else f"# exit {code} (stderr follows)\n{err}"
    return normalise(text, spec)


@pytest.fixture(autouse=True)
def _default_settings(monkeypatch):
    for name in [n for n in os.environ if n.startswith("NCD_") and n not in _KEPT_SETTINGS]:
        monkeypatch.delenv(name)


@pytest.mark.parametrize("spec", SPECS, ids=[s.stem for s in SPECS])
def test_emitted_stages_match_golden(run_cli, spec):
    mismatched, diffs = [], []
    for stage in STAGES:
        golden = GOLDEN / f"{spec.stem}.{stage}"
        text = emitted(run_cli, spec, stage)
        if UPDATE:
            GOLDEN.mkdir(exist_ok=True)
            if not golden.exists() or golden.read_text(encoding="utf-8") != text:
                golden.write_text(text, encoding="utf-8")
            continue
        if not golden.exists():
            pytest.fail(f"no golden file {golden.relative_to(ROOT)} for specs/{spec.name} (a new spec?): run "
                        "`NCD_UPDATE_GOLDEN=1 python -m pytest -q tests/test_golden.py`, review and commit it")
        if golden.read_text(encoding="utf-8") != text:
            mismatched.append(stage)
            diffs.append(_diff(golden, text))
    assert not mismatched, (f"`ncd compile specs/{spec.name} --emit {'/'.join(mismatched)}` differs from "
                            f"tests/golden/{spec.stem}.{{{','.join(mismatched)}}}. If the change is intended, run "
                            "`NCD_UPDATE_GOLDEN=1 python -m pytest -q tests/test_golden.py` and review the diff of "
                            "tests/golden/.\n" + "\n".join(diffs))


def _diff(golden: Path, text: str, most: int = 120) -> str:
    import difflib

    lines = list(difflib.unified_diff(golden.read_text(encoding="utf-8").splitlines(), text.splitlines(),
                                      f"tests/golden/{golden.name}", "emitted now", lineterm="", n=2))
    return "\n".join(lines[:most] + ([f"... ({len(lines) - most} more diff lines)"] if len(lines) > most else []))


def test_no_golden_without_a_spec():
    """A golden file whose spec was removed or renamed is stale: delete it (the update run does not)."""
    names = {s.stem for s in SPECS}
    stale = sorted(p.name for p in GOLDEN.iterdir() if p.suffix.lstrip(".") in STAGES and p.stem not in names)
    assert not stale, f"golden files without a spec in specs/: {', '.join(stale)}; delete them"


def test_normalise_hides_paths_and_digests():
    spec = ROOT / "specs" / "gka.ncd"
    text = f"{spec}:3:1: error\nop gka_{'a1' * 12} digest {'0f' * 32}\nplain_name_is_kept 1234"
    assert normalise(text, spec) == "specs/gka.ncd:3:1: error\nop gka_<op-id> digest <digest>\nplain_name_is_kept 1234"


def test_a_failing_stage_is_pinned_by_its_exit_code_and_error(run_cli, tmp_path):
    spec = tmp_path / "broken.ncd"
    spec.write_text("spec broken\naxis a\nin x[a] : f32\nout y[a] = x[b]\n", encoding="utf-8")
    text = emitted(run_cli, spec, "plan")
    first, _, rest = text.partition("\n")
    assert first == "# exit 1 (stderr follows)"
    assert "specs/broken.ncd:4:" in rest and str(tmp_path) not in rest
