"""Lines of the compiler by part, and of the module generated from each shipped spec, so growth is visible in CI.

    python bench/line_count.py [--no-generated]

Parts (physical lines, `wc -l`, of the files named): core = ncd/**/*.py without the kernels; kernels =
ncd/families/*/kernel*.py (older layouts: ncd/kernels/**/*.py, before that the kernel templates); templates =
templates/* (Jinja and Python); codegen = codegen/*.py; tests = tests/**/*.py. Generated modules are rendered
in-process (`ncd.backend.generate`, what `ncd compile SPEC` writes) with the default settings; a spec that renders
nothing shows why. Always exits 0 on a readable checkout: it reports, CI does not gate on it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _lines(paths: Iterable[Path]) -> tuple[int, int]:
    """(lines, files) of `paths`."""
    files = [p for p in paths if p.is_file() and "__pycache__" not in p.parts]
    return sum(len(p.read_bytes().splitlines()) for p in files), len(files)


def parts(root: Path = ROOT) -> list[tuple[str, str, int, int]]:
    """(part, what it counts, lines, files) for core, kernels, templates, codegen and tests."""
    kernels = sorted((root / "ncd" / "families").glob("*/kernel*.py"))
    kernels_what = "ncd/families/*/kernel*.py"
    if not kernels:  # older layouts: ncd/kernels/, before that the kernel templates
        kernels_dir = root / "ncd" / "kernels"
        if kernels_dir.is_dir():
            kernels, kernels_what = sorted(kernels_dir.rglob("*.py")), "ncd/kernels/**/*.py"
        else:
            kernels, kernels_what = sorted((root / "templates").glob("*.jinja")), "templates/*.jinja"
    kernel_set = set(kernels)
    core = [p for p in (root / "ncd").rglob("*.py") if p not in kernel_set]
    rows = [("core", "ncd/**/*.py without the kernels", core), ("kernels", kernels_what, kernels),
            ("templates", "templates/*.jinja, *.py", sorted((root / "templates").glob("*.jinja"))
             + sorted((root / "templates").glob("*.py"))),
            ("codegen", "codegen/*.py", sorted((root / "codegen").rglob("*.py"))),
            ("tests", "tests/**/*.py", sorted((root / "tests").rglob("*.py")))]
    return [(name, what, *_lines(files)) for name, what, files in rows]


def generated_lengths(specs: Iterable[Path]) -> list[tuple[str, int | str]]:
    """(spec name, lines of its generated module, or why there is none)."""
    try:
        from ncd.backend import generate
        from ncd.pipeline import load_spec
    except ImportError as err:
        return [("(all)", f"ncd not importable: {err}")]
    out: list[tuple[str, int | str]] = []
    for spec in specs:
        try:
            out.append((spec.stem, len(generate(load_spec(spec)).splitlines())))
        except Exception as err:  # a spec no family claims, or a compiler bug: report, do not fail CI
            first = str(err).strip().splitlines()[0] if str(err).strip() else ""
            out.append((spec.stem, f"no module: {type(err).__name__}: {first[:100]}"))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-generated", action="store_true", help="skip rendering the shipped specs")
    args = parser.parse_args(argv)
    print("line counts (physical lines):")
    for name, what, lines, files in parts():
        print(f"  {name:<10} {lines:>7,} lines in {files:>3} files   {what}")
    if not args.no_generated:
        lengths = generated_lengths(sorted((ROOT / "specs").glob("*.ncd")))
        sizes = [n for _, n in lengths if isinstance(n, int)]
        print(f"generated modules ({len(sizes)} of {len(lengths)} shipped specs render"
              + (f"; {min(sizes)} to {max(sizes)} lines, {sum(sizes):,} in all" if sizes else "") + "):")
        for spec, n in lengths:
            print(f"  {spec:<28} {n:>7,}" if isinstance(n, int) else f"  {spec:<28} {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
