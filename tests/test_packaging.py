"""A non-editable install from a built wheel works from any directory: console script, grammar, templates."""

from __future__ import annotations

import os
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from .conftest import ROOT, SPECS


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """Build the wheel and install it, without dependencies, into a fresh venv that borrows them from the
    running interpreter's site-packages (CI has no reason to download them twice). The borrowed directories are
    the running interpreter's own, named in a .pth file: inside a virtualenv the base interpreter that `venv`
    builds from (and its system site-packages) lacks the dependencies."""
    base = tmp_path_factory.mktemp("pkg")
    wheels = base / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(ROOT)],
        check=True, cwd=base,
    )
    (wheel,) = wheels.glob("ncd-*.whl")
    env_dir = base / "venv"
    venv.EnvBuilder(system_site_packages=False, with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    "--no-index", str(wheel)], check=True, cwd=base)
    own = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"], check=True,
                         capture_output=True, text=True).stdout.strip()
    borrowed = [p for p in (*site.getsitepackages(), site.getusersitepackages()) if os.path.isdir(p)]
    # addsitedir (not a bare path) so the borrowed directories' own .pth files run too; after the venv's own
    # site-packages, so the wheel under test comes first; written after pip ran so that pip sees
    # only the venv
    (Path(own) / "_borrowed_dependencies.pth").write_text(
        "".join(f"import site; site.addsitedir({p!r})\n" for p in borrowed))
    workdir = base / "elsewhere"
    workdir.mkdir()
    return env_dir / "bin", workdir


def _run(cmd, cwd):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_console_script_help_and_version(installed):
    bindir, workdir = installed
    result = _run([str(bindir / "ncd"), "--help"], workdir)
    assert result.returncode == 0 and "compile" in result.stdout and "check" in result.stdout
    result = _run([str(bindir / "ncd"), "--version"], workdir)
    assert result.returncode == 0 and result.stdout.startswith("ncd ")


def test_compile_absolute_path_from_any_directory(installed):
    bindir, workdir = installed
    spec = next(p for p in SPECS if p.stem == "spherical_attention").resolve()
    result = _run([str(bindir / "ncd"), "compile", str(spec), "--emit", "ir"], workdir)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("spec spherical_attention")


def test_package_data_comes_from_the_install(installed):
    bindir, workdir = installed
    code = (
        "import ncd, ncd.grammar, ncd.templates, ncd.codegen, ncd.specs, ncd.families.polykan.plan, pathlib; "
        "assert 'T[n+1]' in ncd.families.polykan.plan.SPECS['chebyshev']; "
        "print(ncd.__file__); print(len(ncd.grammar.grammar_text())); "
        "print(sorted(p.name for p in pathlib.Path(ncd.templates.__file__).parent.glob('*.jinja')))"
    )
    result = _run([str(bindir / "python"), "-c", code], workdir)
    assert result.returncode == 0, result.stderr
    location, grammar_chars, templates = result.stdout.splitlines()
    assert str(bindir.parent) in location and str(ROOT) not in location
    assert int(grammar_chars) > 1000
    assert templates != "[]"


def test_the_tree_has_no_symbolic_links():
    """The package is laid out by setuptools' package-dir mapping, not links: links break on Windows checkouts,
    in some archive tools and in sdists. `git ls-files -s` shows mode 120000 for a link."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout (an installed copy has no index to read)")
    listed = subprocess.run(["git", "ls-files", "-s"], cwd=ROOT, check=True, capture_output=True, text=True).stdout
    links = [line.split("\t", 1)[1] for line in listed.splitlines() if line.startswith("120000 ")]
    assert not links, f"symbolic links in the tree: {links}"


def test_every_package_folder_is_listed_for_the_wheel():
    """pyproject.toml lists the packages explicitly (the top-level folders map into `ncd.*`): a new folder under
    ncd/ that is not listed would be missing from a real install while every in-tree test still passed."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib reads pyproject.toml from Python 3.11")
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "ncd").rglob("__init__.py")}
    assert found <= listed, f"not in pyproject.toml's packages: {sorted(found - listed)}"
