"""The compiler driver (ncd/compiler.py) and the family registry (ncd/families/__init__.py): one object through
named stages, each stage run once, every family's "not mine" located, and an op id that changes with everything
that changes the generated text."""

from __future__ import annotations

import os

import pytest

import ncd.backend
import ncd.compiler
from ncd.compiler import STAGES, advance, compile_front, compile_spec
from ncd.families import REGISTRY
from ncd.family import Decline
from ncd.pipeline import front_end

from .conftest import ROOT

GELU = "spec plain_gelu\naxis row\nin x[row] : f32\nout y[row] = x * sigmoid(1.702 * x)\n"


@pytest.fixture
def count_selections(monkeypatch):
    """How often each spec (name, sizes, options) was planned."""
    counts: dict[tuple, int] = {}
    real = ncd.compiler.select

    def counting(front, bindings=None):
        key = (front.program.name, front.sizes, front.options)
        counts[key] = counts.get(key, 0) + 1
        return real(front, bindings)

    monkeypatch.setattr(ncd.compiler, "select", counting)
    return counts


def test_stages_stop_where_asked(tmp_path, count_selections):
    front = front_end(GELU, "gelu.ncd")
    verified = compile_front(front, until="verify")
    assert count_selections == {} and verified.ir is front.program and verified.module is None
    planned = advance(verified, until="plan")
    assert planned.family == "generic" and count_selections == {("plain_gelu", (), ()): 1}
    imported = advance(planned, until="import", cache_dir=tmp_path)
    assert imported.module is not None and imported.path is not None and imported.path.parent == tmp_path
    assert imported.plan is planned.plan and "def plain_gelu(" in imported.code  # carried over, not redone
    assert count_selections == {("plain_gelu", (), ()): 1}
    with pytest.raises(ValueError, match="until must be one of"):
        compile_front(front, until="link")
    assert STAGES[0] == "parse" and STAGES[-1] == "import"


def test_a_cached_module_is_imported_without_planning(tmp_path, count_selections):
    path = tmp_path / "gelu.ncd"
    path.write_text(GELU.replace("plain_gelu", "cached_gelu"))  # a spec no other test imported in this process
    compile_spec(path, cache_dir=tmp_path / "cache")
    assert count_selections == {("cached_gelu", (), ()): 1}
    again = compile_spec(path, cache_dir=tmp_path / "cache")
    assert count_selections == {("cached_gelu", (), ()): 1} and again.module is not None
    assert again.family == "generic" and count_selections == {("cached_gelu", (), ()): 2}  # derived on demand


def test_check_plans_each_compiled_form_once(run_cli, tmp_path, count_selections):
    path = tmp_path / "gelu.ncd"
    path.write_text(GELU)
    code, out, err = run_cli("check", str(path), "--seed", "1")
    assert code == 0, (out, err)
    assert count_selections and set(count_selections.values()) == {1}, count_selections


def test_generic_plan_lists_why_each_specialised_family_declined(run_cli, tmp_path):
    path = tmp_path / "gelu.ncd"
    path.write_text(GELU)
    code, out, err = run_cli("compile", str(path), "--emit", "plan")
    assert code == 0, err
    declined = [line.strip() for line in out.splitlines() if line.strip().startswith("declined by")]
    assert [d.split()[2].rstrip(":") for d in declined] == [f.name for f in REGISTRY[:-1]]
    assert "declined by attention: gelu.ncd:4:1: " in out  # located at the definition that decided it
    assert out.splitlines()[0] == "family: generic"


def test_every_family_declines_a_spec_it_does_not_compile():
    front = front_end(GELU, "gelu.ncd")
    for family in REGISTRY[:-1]:
        answer = family.load(family.planner)(front, {})  # type: ignore[operator]
        assert isinstance(answer, Decline) and answer.reason, family.name


def test_op_id_changes_with_bindings_and_generating_settings(monkeypatch):
    front = front_end((ROOT / "specs" / "gka.ncd").read_text(), "gka.ncd")
    plain = ncd.backend.op_id(front)
    assert ncd.backend.op_id(front, {"time": 512}) != plain
    monkeypatch.setenv("NCD_GKA_DOT_PRECISION", "tf32")
    assert ncd.backend.op_id(front) != plain
    monkeypatch.setenv("NCD_DEBUG", "1")  # steers the compiler's process only
    monkeypatch.delenv("NCD_GKA_DOT_PRECISION")
    assert ncd.backend.op_id(front) == plain


def test_planning_imports_no_kernel_module():
    """Planning every shipped spec loads neither Triton nor a kernel module: `@triton.jit` reads TRITON_INTERPRET
    when a kernel module is imported, so `ncd check` decides CPU interpreter or GPU after planning, and a kernel
    loaded by a planner would stay compiled-only (an `ncd check` on the CPU failed that way)."""
    import subprocess
    import sys

    code = ("import pathlib, sys\n"
            "from ncd.compiler import compile_front\nfrom ncd.pipeline import front_end\n"
            "for p in sorted(pathlib.Path('specs').glob('*.ncd')):\n"
            "    compile_front(front_end(p.read_text(), str(p)), until='plan')\n"
            "print(' '.join(m for m in sys.modules if m == 'triton' or '.kernel' in m))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == []
