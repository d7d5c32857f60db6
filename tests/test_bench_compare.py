"""bench/compare.py's plumbing on the CPU: trees, parsing each bench's output, the table and exit status.

The benches themselves need a GPU; here a fake runner prints what each bench prints (its own format strings),
so parsing, the median over runs, the 3% flag and the split-over-calls workdir are what is tested.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT


@pytest.fixture(scope="module")
def compare():
    spec = importlib.util.spec_from_file_location("bench_compare", ROOT / "bench" / "compare.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_compare"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _attention_output(ms: float) -> str:
    rows = [{"n": 4096, "batch": 8, "causal": False, "impl": "spherical", "mode": "fwd", "ms": ms},
            {"n": 4096, "batch": 8, "causal": True, "impl": "sdpa", "mode": "fwdbwd", "ms": 2.0},
            {"n": 4096, "batch": 8, "causal": True, "impl": "eager_spherical", "mode": "fwd", "ms": None}]
    return ("device=NVIDIA H100 80GB HBM3 torch=2.11\ncheck spherical causal=False bwd=default OK\n"
            + "\n".join(json.dumps(r) for r in rows) + "\ncorrectness OK (3 s incl. compile and autotune)\n")


POLYKAN = """device: NVIDIA H100 80GB HBM3  torch 2.11
| config (B, Din, Dout, degree) | variant | fwd ms | bwd ms | fwd+bwd ms | launches/step | GPU ms/step | x |
|---|---|---:|---:|---:|---:|---:|---:|
| (128, 40, 256, 8) | ncd (LUT, kernel layout) | 0.0200 | 0.0400 | 0.0600 | 3 | 0.0100 | 1.00x |
| (128, 40, 256, 8) | eager acos | 0.1000 | 0.2000 | 0.3000 | - | - | 5.00x |
correctness: ok
"""
GKA_LINES = "device NVIDIA H100\n  T 2048 r 10: T 2048, gdn 0.500, r 10, fwd 0.270, fb 2.350\ncorrectness: all OK\n"
RATIONAL_TABLE = """device: H100 | torch
== group rational, X = [1024, 197, 768] fp32, G = 8 | H100 | torch 2.11 | 2026-11-25 | correct: True | 40 s
measurement                              ms    GB/s  % copy
fwd ncd                               0.400    3000   90.0%
fwd eager                             2.000
fwd+bwd ncd (autograd)                1.250

"""


def test_parsers_read_each_bench_format(compare, tmp_path):
    rows = compare.parse_attention(_attention_output(1.5), tmp_path)
    assert rows == {"N 4096 B 8 | spherical fwd": 1.5, "N 4096 B 8 causal | sdpa fwdbwd": 2.0}  # OOM row left out
    assert compare.parse_polykan(POLYKAN, tmp_path) == {
        "(128, 40, 256, 8) | ncd (LUT, kernel layout) fwd": 0.02, "(128, 40, 256, 8) | ncd (LUT, kernel layout) bwd":
        0.04, "(128, 40, 256, 8) | ncd (LUT, kernel layout) fwd+bwd": 0.06, "(128, 40, 256, 8) | eager acos fwd": 0.1,
        "(128, 40, 256, 8) | eager acos bwd": 0.2, "(128, 40, 256, 8) | eager acos fwd+bwd": 0.3}
    assert compare.parse_gka(GKA_LINES, tmp_path) == {"T 2048 r 10 | gdn": 0.5, "T 2048 r 10 | fwd": 0.27,
                                                      "T 2048 r 10 | fb": 2.35}
    shape = "X = [1024, 197, 768] fp32, G = 8 | "
    assert compare.parse_rational(RATIONAL_TABLE, tmp_path) == {shape + "fwd ncd": 0.4, shape + "fwd eager": 2.0,
                                                                shape + "fwd+bwd ncd (autograd)": 1.25}
    # the JSON files the benches write under $OUT win over the printed (rounded) numbers
    (tmp_path / "gka.json").write_text(json.dumps({"rows": [{"T": 2048, "r": 10, "fwd": 0.2712, "gla": None}]}))
    (tmp_path / "rational.json").write_text(json.dumps({"ms": {"fwd ncd": 0.4012, "bwd KAT-style": None}}))
    assert compare.parse_gka(GKA_LINES, tmp_path) == {"T 2048 r 10 | fwd": 0.2712}
    assert compare.parse_rational(RATIONAL_TABLE, tmp_path) == {shape + "fwd ncd": 0.4012}


def test_ours_and_correctness(compare):
    assert compare.is_ours("attention", "N 1 B 1 | spherical[atomic] fwdbwd")
    assert not compare.is_ours("attention", "N 1 B 1 | sdpa fwd")
    assert compare.is_ours("gka", "T 2048 r 10 | fwd") and not compare.is_ours("gka", "T 2048 r 10 | gdn")
    assert compare.is_ours("polykan", "(1, 2, 3, 4) | ncd (LUT) fwd")
    assert not compare.is_ours("rational", "fwd FlashKAT-style")
    assert compare.correctness("correctness OK", 0) is True
    assert compare.correctness("correctness: FAILED: r 10", 0) is False
    assert compare.correctness("== group rational | correct: False | 3 s", 0) is False
    assert compare.correctness("correctness: ok", 1) is False
    assert compare.correctness("no verdict here", 0) is None


def test_mirror_follows_links_and_maps_package_dirs(compare, tmp_path):
    tree = tmp_path / "tree"
    (tree / "ncd").mkdir(parents=True)
    (tree / "codegen").mkdir()
    (tree / "ncd" / "__init__.py").write_text("")
    (tree / "ncd" / "extra").mkdir()
    (tree / "ncd" / "extra" / "__init__.py").write_text("")
    (tree / "codegen" / "__init__.py").write_text("X = 1\n")
    (tree / "ncd" / "codegen").symlink_to("../codegen")  # the old tree's layout
    (tree / "pyproject.toml").write_text('[tool.setuptools]\npackage-dir = { "ncd" = "ncd", "ncd.codegen" = '
                                         '"codegen" }\npackages = ["ncd", "ncd.codegen"]\n')
    site = tmp_path / "site"
    warnings = compare.mirror_installed_layout(tree, site)
    assert (site / "ncd" / "codegen" / "__init__.py").read_text() == "X = 1\n"
    assert not (site / "ncd" / "codegen").is_symlink()
    assert len(warnings) == 1 and "ncd.extra" in warnings[0]


def test_archive_unpacks_a_commit_with_its_links(compare, tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "a.txt").write_text("old\n")
    (repo / "link").symlink_to("a.txt")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "one"], check=True)
    (repo / "a.txt").write_text("new\n")  # uncommitted: not in the archive
    commit = compare.archive("HEAD", tmp_path / "out", repo)
    assert len(commit) == 40
    assert (tmp_path / "out" / "a.txt").read_text() == "old\n"
    assert (tmp_path / "out" / "link").is_symlink()
    with pytest.raises(SystemExit, match="cannot resolve"):
        compare.archive("no-such-ref", tmp_path / "out2", repo)
    # where the checkout has no history (a device machine's copy): a tar made elsewhere, or an unpacked tree
    subprocess.run([*git, "archive", "-o", str(tmp_path / "old.tar"), "HEAD"], check=True)
    label = compare.unpack_old(str(tmp_path / "old.tar"), tmp_path / "from_tar", repo)
    assert label == f"old.tar (commit {commit[:12]})"
    assert (tmp_path / "from_tar" / "a.txt").read_text() == "old\n" and (tmp_path / "from_tar" / "link").is_symlink()
    assert compare.unpack_old(str(tmp_path / "out"), tmp_path / "from_dir", repo).startswith("directory ")
    assert (tmp_path / "from_dir" / "link").is_symlink()


def test_runs_alternate_and_the_table_flags_slower_ncd_rows(compare, tmp_path, monkeypatch, capsys):
    trees = {side: compare.Tree(side, tmp_path / side, tmp_path / side / "site", side) for side in ("old", "new")}
    monkeypatch.setattr(compare, "prepare_trees", lambda workdir, ref: trees)
    calls = []

    def fake_runner(command, env, cwd, log, timeout):
        side = "old" if env["PYTHONPATH"].startswith(str(tmp_path / "old")) else "new"
        family = Path(command[1]).stem
        calls.append((family, side))
        assert Path(env["OUT"]).is_dir() and env["NCD_CACHE_DIR"].endswith(side)
        text = {"attention": _attention_output(1.0 if side == "old" else 1.05), "polykan": POLYKAN}[family]
        log.write_text(text)
        return 0

    workdir = tmp_path / "work"
    code = compare.main(["--workdir", str(workdir), "--families", "attention,polykan", "--repeats", "2"],
                        runner=fake_runner)
    out = capsys.readouterr().out
    assert calls == [("attention", "old"), ("attention", "new"), ("attention", "new"), ("attention", "old"),
                     ("polykan", "old"), ("polykan", "new"), ("polykan", "new"), ("polykan", "old")]
    assert code == 1
    assert "| attention | N 4096 B 8 | spherical fwd | ncd | 1.0000 | 1.0500 | 1.050 | SLOWER |" in out
    assert "| attention | N 4096 B 8 causal | sdpa fwdbwd | baseline | 2.0000 | 2.0000 | 1.000 |  |" in out
    assert "1 of 4 ncd rows slower than old by more than 3%: attention N 4096 B 8 | spherical fwd 1.050" in out
    # a later call adds runs to the same workdir; --report-only tabulates all of them (median per side)
    code = compare.main(["--workdir", str(workdir), "--families", "polykan", "--report-only"])
    out = capsys.readouterr().out
    assert code == 0 and "old: old; 2 runs" in out and "0 of 3 ncd rows slower" in out


def test_bench_args_and_quick(compare):
    args = compare.parse_args(["--quick", "--bench-args", "gka=--ts 4096 --no-naive"])
    assert compare.bench_args(args, "gka") == ["--ts", "4096", "--no-naive"]
    assert compare.bench_args(args, "polykan") == ["--no-sweep"]
    with pytest.raises(SystemExit):
        compare.parse_args(["--families", "nope"])
