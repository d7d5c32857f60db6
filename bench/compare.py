"""Old code against new code, same run, same machine: each family's GPU bench from both trees, one table.

    python bench/compare.py [--ref 637edd4] [--families attention,rational,polykan,gka] [--quick]
                            [--bench-args 'gka=--ts 2048 --rs 10'] [--repeats 2] [--workdir DIR] [--dry-run]
                            [--json PATH]  (the table in bench/results.py's format, for bench/plot.py)

The old tree is `git archive REF` of this repository (default 637edd4, the last commit before issue 31's work;
where the checkout has no git history, as on a device machine's copy, pass `--ref old.tar` made by
`git archive -o old.tar 637edd4` where it has, or `--ref DIR`, an unpacked tree);
the new tree is this working tree as it is on disk (uncommitted changes included). Each tree's packages are copied
into DIR/<side>/site in the installed layout (pyproject.toml's [tool.setuptools] package-dir: `codegen/` becomes
`ncd/codegen/` and so on; symbolic links are followed, so the old tree's `ncd/codegen -> ../codegen` works too), no
pip and no network. Then for each family each tree runs *its own* bench script (`<tree>/bench/FAMILY.py`, which
knows that tree's API) in a subprocess with PYTHONPATH=DIR/<side>/site (ahead of any installed ncd), from an empty
directory, with its own NCD_CACHE_DIR; old and new alternate (old first, then new first on the next repeat).
Every run's output goes to DIR/logs/FAMILY.SIDE.N.log and the table is built from all logs in DIR, so a long
comparison can be split over several calls on the same machine (`--sides old`, `--sides new`, `--report-only`
with the same --workdir).

Rows parsed from each bench's output (the median over repeats): attention: its JSON row lines (N, B, causal,
impl, fwd or fwdbwd); rational: $OUT/rational.json's "ms" (else the measurement table); polykan: the final
table's fwd / bwd / fwd+bwd per (config, variant); gka: $OUT/gka.json's rows (else the `T .. r ..:` lines) per
(T, r, quantity). The table: family, shape, old ms, new ms, new/old; `SLOWER` where new/old > 1 + threshold (3%).
Rows of ncd's own kernels are marked `ncd`; the others (SDPA, eager, torch.compile, fla, hand-written Triton)
run the same code on both sides, so their ratios show the run-to-run noise. Exit status 1 when an ncd row is
slower, a bench failed its correctness check or exited non-zero, or nothing was parsed.

--quick passes each bench its short form (QUICK below; --bench-args FAMILY=ARGS replaces it for one family).
--dry-run prepares both trees and prints the commands without running them (works without a GPU).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_REF = "637edd4"
FAMILIES = ("attention", "rational", "polykan", "gka")
SIDES = ("old", "new")
QUICK = {
    "attention": "--quick --impls sdpa,spherical,softmax,spherical_streamed,spherical_factorized",
    "rational": "--skip-kat",
    "polykan": "--no-sweep",
    "gka": "--ts 2048 --rs 10 --no-naive --variants default",
}
OUT_FILES = {"attention": "attention_bench.json", "rational": "rational.json", "gka": "gka.json"}
LOG = re.compile(r"^(?P<family>[a-z_]+)\.(?P<side>old|new)\.(?P<index>\d+)\.log$")


# ----------------------------------------------------------------------------------------------- trees


def read_package_dirs(tree: Path) -> dict[str, str]:
    """pyproject.toml's [tool.setuptools] package-dir of `tree` (package -> folder), plus `packages` at their
    default folders; {"ncd": "ncd"} when there is no such table."""
    text = (tree / "pyproject.toml").read_text(encoding="utf-8") if (tree / "pyproject.toml").is_file() else ""
    try:
        import tomllib

        table = tomllib.loads(text).get("tool", {}).get("setuptools", {})
    except ImportError:  # Python 3.10: the one line this project writes
        match = re.search(r"^package-dir\s*=\s*\{(.*)\}", text, re.M)
        table = {"package-dir": dict(re.findall(r'"([\w.]+)"\s*=\s*"([^"]+)"', match.group(1)))} if match else {}
    mapping = dict(table.get("package-dir", {}))
    for package in table.get("packages", []):
        mapping.setdefault(package, package.replace(".", "/"))
    return mapping or {"ncd": "ncd"}


def mirror_installed_layout(tree: Path, site: Path) -> list[str]:
    """Copy `tree`'s packages into `site` as pip would install them (symbolic links followed; a package's
    sub-folders come along whole). Returns warnings: sub-packages that pyproject.toml's `packages` leaves out, which
    a real `pip install .` would not install."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    mapping = read_package_dirs(tree)
    for package in sorted(mapping, key=lambda p: p.count(".")):  # parents first; children overwrite link copies
        source = tree / mapping[package]
        if not source.is_dir():
            raise SystemExit(f"{tree}: package {package} maps to {mapping[package]}, which is not a folder")
        shutil.copytree(source, site / package.replace(".", "/"), symlinks=False, ignore=ignore,
                        dirs_exist_ok=True)
    found = {".".join(init.parent.relative_to(site).parts) for init in site.rglob("__init__.py")}
    return [f"{tree}: package {name} is not in pyproject.toml's packages (pip install . would leave it out)"
            for name in sorted(found - set(mapping)) if len(mapping) > 1]


def _untar(tar: tarfile.TarFile, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    if hasattr(tarfile, "tar_filter"):
        tar.extractall(dest, filter="tar")  # keeps the tree's relative symbolic links
    else:
        tar.extractall(dest)


def archive(ref: str, dest: Path, repo: Path = ROOT) -> str:
    """`git archive REF` of `repo` unpacked into `dest`; returns the full commit hash."""
    commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", f"{ref}^{{commit}}"],
                            capture_output=True, text=True, check=False)
    if commit.returncode != 0:
        raise SystemExit(f"git cannot resolve {ref!r} in {repo}: {commit.stderr.strip() or 'no git history'} (where "
                         f"the checkout has no history, run `git archive -o old.tar {ref}` where it has, and pass "
                         "--ref old.tar)")
    data = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", commit.stdout.strip()],
                          capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        _untar(tar, dest)
    return commit.stdout.strip()


def unpack_old(ref: str, dest: Path, repo: Path = ROOT) -> str:
    """The old tree into `dest` from a git ref, a tar file (`git archive -o old.tar REF`) or a directory; a label."""
    path = Path(ref)
    if path.is_dir():
        shutil.copytree(path, dest, symlinks=True, ignore=shutil.ignore_patterns(".git", "__pycache__"))
        return f"directory {path.resolve()}"
    if path.is_file():
        with tarfile.open(path) as tar:
            _untar(tar, dest)
        try:
            with path.open("rb") as handle:
                comment = subprocess.run(["git", "get-tar-commit-id"], stdin=handle, capture_output=True, text=True,
                                         check=False).stdout.strip()
        except OSError:  # no git here
            comment = ""
        return f"{path.name}{f' (commit {comment[:12]})' if comment else ''}"
    return archive(ref, dest, repo)[:12]


@dataclass
class Tree:
    side: str
    source: Path  # where bench/FAMILY.py and specs/ are read
    site: Path  # PYTHONPATH: the packages in the installed layout
    label: str  # commit or "working tree"


def prepare_trees(workdir: Path, ref: str, repo: Path = ROOT) -> dict[str, Tree]:
    """The old tree (archived once per workdir and ref) and the new one (this working tree, copied afresh)."""
    old_dir = workdir / "old"
    marker = old_dir / "REF.json"
    if not (marker.is_file() and json.loads(marker.read_text())["ref"] == ref):
        shutil.rmtree(old_dir, ignore_errors=True)
        label = unpack_old(ref, old_dir / "src", repo)
        for warning in mirror_installed_layout(old_dir / "src", old_dir / "site"):
            print(f"warning: {warning}", file=sys.stderr)
        marker.write_text(json.dumps({"ref": ref, "label": label}))
    old_label = json.loads(marker.read_text())["label"]
    new_site = workdir / "new" / "site"
    shutil.rmtree(new_site, ignore_errors=True)
    for warning in mirror_installed_layout(repo, new_site):
        print(f"warning: {warning}", file=sys.stderr)
    dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain"], capture_output=True, text=True,
                           check=False).stdout.strip()
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                          text=True, check=False).stdout.strip()
    new_label = f"{head or 'working tree'}{' + uncommitted changes' if dirty else ''}"
    return {"old": Tree("old", old_dir / "src", old_dir / "site", old_label),
            "new": Tree("new", repo, new_site, new_label)}


# ----------------------------------------------------------------------------------------------- running


def bench_command(tree: Tree, family: str, args: list[str], python: str = sys.executable) -> list[str]:
    return [python, str(tree.source / "bench" / f"{family}.py"), *args]


def bench_env(tree: Tree, workdir: Path, out_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree.site), *filter(None, [env.get("PYTHONPATH")])])
    env["OUT"] = str(out_dir)
    env["NCD_CACHE_DIR"] = str(workdir / "cache" / tree.side)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


Runner = Callable[[list[str], dict[str, str], Path, Path, float | None], int]


def run_subprocess(command: list[str], env: dict[str, str], cwd: Path, log: Path, timeout: float | None) -> int:
    """Run one bench, its stdout and stderr into `log` as they come (a timed-out run keeps what it printed)."""
    with log.open("w", encoding="utf-8") as handle:
        handle.write(f"# {shlex.join(command)}\n")
        handle.flush()
        try:
            return subprocess.run(command, env=env, cwd=cwd, stdout=handle, stderr=subprocess.STDOUT,
                                  timeout=timeout, check=False).returncode
        except subprocess.TimeoutExpired:
            handle.write(f"\n# compare.py: timed out after {timeout} s\n")
            return 124


def next_index(logs: Path, family: str, side: str) -> int:
    taken = [int(m["index"]) for p in logs.glob(f"{family}.{side}.*.log") if (m := LOG.match(p.name))]
    return max(taken, default=0) + 1


# ----------------------------------------------------------------------------------------------- parsing


@dataclass
class Run:
    family: str
    side: str
    index: int
    exit_code: int | None
    rows: dict[str, float] = field(default_factory=dict)
    correct: bool | None = None
    device: str = ""
    last_line: str = ""


def _json_file(out_dir: Path, family: str) -> dict | None:
    path = out_dir / OUT_FILES.get(family, "-")
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (OSError, ValueError):
        return None


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def parse_attention(text: str, out_dir: Path) -> dict[str, float]:
    rows: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("{") and '"impl"' in line:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            ms = _number(row.get("ms"))
            if ms is not None:
                shape = f"N {row['n']} B {row['batch']}{' causal' if row['causal'] else ''}"
                rows[f"{shape} | {row['impl']} {row['mode']}"] = ms
    return rows


def parse_rational(text: str, out_dir: Path) -> dict[str, float]:
    shape = re.search(r"== group rational, (X = \[[\d, ]+\][^|]*)", text)
    prefix = f"{shape[1].strip()} | " if shape else ""
    found = _json_file(out_dir, "rational")
    if found and isinstance(found.get("ms"), dict):
        return {prefix + name: ms for name, value in found["ms"].items() if (ms := _number(value)) is not None}
    rows: dict[str, float] = {}
    in_table = False
    for line in text.splitlines():
        if line.startswith("measurement"):
            in_table = True
        elif in_table and (match := re.match(r"^(\S.*?)\s+(\d+\.\d+)(\s|$)", line)):
            rows[prefix + match[1].strip()] = float(match[2])
        elif in_table:
            in_table = False
    return rows


_POLYKAN_ROW = re.compile(r"^\| (\([\d, ]+\)) \| (.+?) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|")


def parse_polykan(text: str, out_dir: Path) -> dict[str, float]:
    rows: dict[str, float] = {}
    for line in text.splitlines():
        if match := _POLYKAN_ROW.match(line):
            config, variant = match[1], match[2]
            for mode, value in zip(("fwd", "bwd", "fwd+bwd"), match.groups()[2:], strict=True):
                rows[f"{config} | {variant} {mode}"] = float(value)
    return rows


_GKA_LINE = re.compile(r"^\s+T (\d+) r (\d+): (.*)$")


def parse_gka(text: str, out_dir: Path) -> dict[str, float]:
    found = _json_file(out_dir, "gka")
    cells: list[dict] = list(found.get("rows", [])) if found else []
    if not cells:
        for line in text.splitlines():
            if match := _GKA_LINE.match(line):
                cell: dict[str, object] = {"T": int(match[1]), "r": int(match[2])}
                for pair in match[3].split(", "):
                    key, _, value = pair.partition(" ")
                    try:
                        cell.setdefault(key, float(value))
                    except ValueError:
                        continue
                cells.append(cell)
    rows: dict[str, float] = {}
    for cell in cells:
        for key, value in cell.items():
            ms = _number(value)
            if key not in ("T", "r") and ms is not None:
                rows[f"T {cell['T']} r {cell['r']} | {key}"] = ms
    return rows


PARSERS: dict[str, Callable[[str, Path], dict[str, float]]] = {
    "attention": parse_attention, "rational": parse_rational, "polykan": parse_polykan, "gka": parse_gka}

_GKA_OURS = {"fwd", "fb", "fb_tf32", "fwd_tf32", "fwd_bf16", "fwd_kernels"}


def is_ours(family: str, key: str) -> bool:
    """Whether a row times ncd's own kernels (the others are baselines, the same code on both sides)."""
    what = key.split(" | ", 1)[-1]
    if family == "attention":
        return what.split(" ")[0].split("[")[0] in ("spherical", "softmax", "spherical_streamed",
                                                     "spherical_factorized")
    if family == "rational":
        return "ncd" in what or "KATGroup" in what
    if family == "polykan":
        return what.startswith("ncd")
    if family == "gka":
        return what in _GKA_OURS
    return True


def correctness(text: str, exit_code: int | None) -> bool | None:
    """False when the bench reports a failed check (or exited non-zero), True when it reports passing, else None."""
    lines = [line for line in text.splitlines() if re.search(r"correct", line, re.I) and not line.startswith("#")]
    if exit_code not in (None, 0) or any(re.search(r"fail|correct: false", line, re.I) for line in lines):
        return False
    return True if any(re.search(r"\b(ok|true)\b", line, re.I) for line in lines) else None


def read_run(log: Path, workdir: Path) -> Run:
    match = LOG.match(log.name)
    assert match is not None
    family, side, index = match["family"], match["side"], int(match["index"])
    text = log.read_text(encoding="utf-8", errors="replace")
    code_file = log.with_suffix(".exit")
    exit_code = int(code_file.read_text()) if code_file.is_file() else None
    out_dir = workdir / "out" / f"{family}.{side}.{index}"
    lines = text.splitlines()
    device = next((line.strip() for line in lines if line.lower().startswith("device")), "")
    last = next((line.strip() for line in reversed(lines) if line.strip()), "")
    return Run(family, side, index, exit_code, PARSERS[family](text, out_dir), correctness(text, exit_code),
               device, last)


# ----------------------------------------------------------------------------------------------- report


@dataclass
class Row:
    family: str
    shape: str
    old: float | None
    new: float | None
    ours: bool

    @property
    def ratio(self) -> float | None:
        return self.new / self.old if self.old and self.new is not None else None


def combine(runs: Iterable[Run]) -> list[Row]:
    """One row per (family, key): the median of each side's runs."""
    samples: dict[tuple[str, str], dict[str, list[float]]] = {}
    for run in runs:
        for key, ms in run.rows.items():
            samples.setdefault((run.family, key), {"old": [], "new": []})[run.side].append(ms)
    order = {family: i for i, family in enumerate(FAMILIES)}
    rows = []
    for (family, key), by_side in sorted(samples.items(), key=lambda kv: (order.get(kv[0][0], 99), kv[0][1])):
        old, new = (statistics.median(by_side[s]) if by_side[s] else None for s in SIDES)
        rows.append(Row(family, key, old, new, is_ours(family, key)))
    return rows


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def report(runs: list[Run], trees: dict[str, str], threshold: float, write: Callable[[str], None] = print) -> int:
    """Print the table; the exit status (1: an ncd row slower than 1 + threshold, a failed check, no rows)."""
    rows = combine(runs)
    for side in SIDES:
        mine = [r for r in runs if r.side == side]
        devices = sorted({r.device for r in mine if r.device})
        write(f"{side}: {trees.get(side, '?')}; {len(mine)} runs; " + ("; ".join(devices) or "device not printed"))
    write("")
    write("| family | shape | measurement | times | old ms | new ms | new/old | |")
    write("|---|---|---|---|---:|---:|---:|---|")
    slower = []
    for row in rows:
        ratio = row.ratio
        flag = ratio is not None and ratio > 1 + threshold
        if flag and row.ours:
            slower.append(row)
        shape, _, measurement = row.shape.rpartition(" | ")
        write(f"| {row.family} | {shape or '-'} | {measurement} | {'ncd' if row.ours else 'baseline'} | "
              f"{_ms(row.old)} | {_ms(row.new)} | {'-' if ratio is None else f'{ratio:.3f}'} | "
              f"{'SLOWER' if flag else ''} |")
    write("")
    baseline = [r.ratio for r in rows if not r.ours and r.ratio is not None]
    if baseline:
        write(f"noise (baselines, the same code on both sides): new/old {min(baseline):.3f} to {max(baseline):.3f}, "
              f"median {statistics.median(baseline):.3f} over {len(baseline)} row(s)")
    failed = [r for r in runs if r.correct is False]
    for run in failed:
        write(f"FAILED: {run.family} {run.side} run {run.index} (exit {run.exit_code}): a correctness check failed or "
              f"the bench did not finish; its log ends: {run.last_line[:200]}")
    unknown = [r for r in runs if r.correct is None]
    for run in unknown:
        write(f"note: {run.family} {run.side} run {run.index} printed no correctness verdict")
    ours = [r for r in rows if r.ours and r.ratio is not None]
    one_sided = [r for r in rows if r.ours and r.ratio is None]
    if one_sided:
        write(f"{len(one_sided)} ncd rows timed on one side only (not compared): "
              + "; ".join(f"{r.family} {r.shape} ({'old' if r.new is None else 'new'} only)" for r in one_sided[:20])
              + (" ..." if len(one_sided) > 20 else ""))
    write(f"{len(slower)} of {len(ours)} ncd rows slower than old by more than {threshold:.0%}"
          + (": " + "; ".join(f"{r.family} {r.shape} {r.ratio:.3f}" for r in slower) if slower else ""))
    if not rows:
        write("no timing rows parsed")
    return 1 if slower or failed or one_sided or not rows else 0


# ----------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ref", default=DEFAULT_REF, help=f"the old code: a git ref (default {DEFAULT_REF}), a tar "
                        "file from `git archive -o FILE REF`, or a directory")
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma list (default: all four)")
    parser.add_argument("--quick", action="store_true", help="each bench's short form (see QUICK)")
    parser.add_argument("--bench-args", action="append", default=[], metavar="FAMILY=ARGS",
                        help="arguments for one family's bench, on both sides (repeatable; replaces --quick's)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per side, alternating order (median)")
    parser.add_argument("--sides", default="old,new", help="which trees to run in this call (default both)")
    parser.add_argument("--threshold", type=float, default=0.03, help="flag new/old above 1 + this (0.03)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per bench run (default: none)")
    parser.add_argument("--workdir", default=None, help="trees, logs and caches (default: a new temp dir); reuse "
                        "it to add runs or to --report-only")
    parser.add_argument("--report-only", action="store_true", help="run nothing: the table of the logs in --workdir")
    parser.add_argument("--dry-run", action="store_true", help="prepare the trees, print the commands, run nothing")
    parser.add_argument("--python", default=sys.executable, help="interpreter for the benches")
    parser.add_argument("--json", help="also write the table to this file (bench/results.py's format)")
    args = parser.parse_args(argv)
    args.families = [f for f in args.families.split(",") if f]
    args.sides = [s for s in args.sides.split(",") if s]
    for family in args.families:
        if family not in FAMILIES:
            parser.error(f"unknown family {family!r}; families: {', '.join(FAMILIES)}")
    for side in args.sides:
        if side not in SIDES:
            parser.error(f"unknown side {side!r}; sides: old, new")
    extra = {}
    for item in args.bench_args:
        family, sep, value = item.partition("=")
        if not sep or family not in FAMILIES:
            parser.error(f"--bench-args takes FAMILY=ARGS with FAMILY one of {', '.join(FAMILIES)}, got {item!r}")
        extra[family] = shlex.split(value)
    args.extra = extra
    if args.report_only and not args.workdir:
        parser.error("--report-only reads the logs of an earlier --workdir")
    return args


def bench_args(args: argparse.Namespace, family: str) -> list[str]:
    if family in args.extra:
        return args.extra[family]
    return shlex.split(QUICK[family]) if args.quick else []


def main(argv: list[str] | None = None, runner: Runner = run_subprocess) -> int:
    args = parse_args(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="ncd-compare-")).resolve()
    logs = workdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    print(f"workdir {workdir}", flush=True)
    trees_file = workdir / "trees.json"
    if not args.report_only:
        trees = prepare_trees(workdir, args.ref)
        labels = {side: tree.label for side, tree in trees.items()}
        trees_file.write_text(json.dumps(labels))
        empty = workdir / "cwd"
        empty.mkdir(exist_ok=True)
        for family in args.families:
            for repeat in range(args.repeats):
                order = args.sides if repeat % 2 == 0 else list(reversed(args.sides))
                for side in order:
                    tree = trees[side]
                    index = next_index(logs, family, side)
                    out_dir = workdir / "out" / f"{family}.{side}.{index}"
                    out_dir.mkdir(parents=True, exist_ok=True)
                    command = bench_command(tree, family, bench_args(args, family), args.python)
                    env = bench_env(tree, workdir, out_dir)
                    if args.dry_run:
                        print(f"[dry run] cd {empty} && PYTHONPATH={env['PYTHONPATH']} OUT={out_dir} "
                              f"NCD_CACHE_DIR={env['NCD_CACHE_DIR']} {shlex.join(command)}")
                        continue
                    log = logs / f"{family}.{side}.{index}.log"
                    start = time.time()
                    print(f"[compare] {family} {side} run {index} ...", end=" ", flush=True)
                    code = runner(command, env, empty, log, args.timeout)
                    log.with_suffix(".exit").write_text(str(code))
                    run = read_run(log, workdir)
                    print(f"{time.time() - start:.0f} s, exit {code}, {len(run.rows)} rows", flush=True)
        if args.dry_run:
            return 0
    labels = json.loads(trees_file.read_text()) if trees_file.is_file() else {}
    runs = [read_run(p, workdir) for p in sorted(logs.glob("*.log"))
            if (m := LOG.match(p.name)) and m["family"] in args.families]
    print(f"ref {args.ref}; threshold {args.threshold:.0%}; logs in {logs}")
    status = report(runs, labels, args.threshold)
    if args.json:
        from results import compare_runs, write_results  # bench/results.py, beside this script

        devices = {r.family: r.device for r in runs if r.side == "new" and r.device}
        write_results(args.json, compare_runs(combine(runs), args.threshold, devices, labels,
                                              source=f"bench/compare.py --ref {args.ref}"))
    return status


if __name__ == "__main__":
    sys.exit(main())
