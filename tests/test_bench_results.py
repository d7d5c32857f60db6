"""bench/results.py (the shared results format), bench/log_results.py (bench/results/*.json from the logged tables)
and bench/plot.py (one PNG per family).

The plotting tests need matplotlib, which the project does not require (it is the optional `bench` extra, and CI
does not install it): they, and only they, are skipped without it (`pytest.importorskip("matplotlib")`). Everything
else, the round trip included, runs without matplotlib.
"""

from __future__ import annotations

import importlib.util
import json
import struct
import sys
from pathlib import Path

import pytest

from .conftest import ROOT

BENCH = ROOT / "bench"
FAMILIES = ("attention", "rational", "polykan", "gka", "generic")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def results():
    return _load("results")


def _run(results, **kw):
    rows = [results.Row("N 1000 B 3 causal", "spherical fwd+bwd", "SDPA fwd+bwd", 2.0, 1.5, target=1.0),
            results.Row("N 1000 B 3 causal", "fwd ncd", "device copy bandwidth", 0.3, None, ratio=0.87, target=0.85),
            results.Row("(7, 5, 3, 2)", "sdpa fwd", "old code", 1.1, 1.0, times="baseline")]
    return results.Run(family="attention", device="NVIDIA H100 80GB HBM3", date="2026-11-26", commit="abc1234",
                       rows=rows, **kw)


def test_results_round_trip(results, tmp_path):
    runs = [_run(results), _run(results, title="new code against old", against="637edd4",
                                ratio_label=results.OLD_OVER_NEW)]
    path = results.write_results(tmp_path / "sub" / "attention.json", runs)
    assert json.loads(path.read_text())["format"] == results.FORMAT
    back = results.read_results(path)
    assert back == runs
    first = back[0].rows
    assert first[0].ratio == pytest.approx(0.75) and first[0].met is False  # baseline ms / ncd ms, below its target
    assert first[1].ratio == 0.87 and first[1].met is True  # a bandwidth fraction: the ratio as given
    assert first[2].met is None and first[2].times == "baseline"
    with pytest.raises(ValueError, match="times"):
        results.Row("s", "v", "b", 1.0, 1.0, times="mine")
    data = json.loads(path.read_text())
    data["runs"][0]["rows"][0]["speed"] = 1.0
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="unknown row fields"):
        results.read_results(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="not a bench results file"):
        results.read_results(tmp_path / "other.json")


def test_bench_rows_pair_ncd_with_each_baseline(results):
    native = [{"n": 1000, "batch": 3, "causal": c, "impl": impl, "mode": mode, "ms": ms}
              for c in (False, True) for impl, mode, ms in (
                  ("spherical", "fwdbwd", 2.0), ("sdpa", "fwdbwd", 3.0), ("softmax", "fwd", 1.0), ("sdpa", "fwd", 0.8),
                  ("compiled_spherical", "fwdbwd", 5.0), ("spherical[atomic]", "fwdbwd", 2.5))]
    rows = {(r.shape, r.variant, r.baseline): r for r in results.attention_rows(native)}
    assert len(rows) == 10  # spherical: SDPA and compile; softmax: SDPA; the variant: SDPA and compile; x2 shapes
    row = rows[("N 1000 B 3 causal", "spherical fwd+bwd", "SDPA fwd+bwd")]
    assert (row.ratio, row.target) == (1.5, 1.0)
    assert rows[("N 1000 B 3", "softmax fwd", "SDPA fwd")].met is False  # 0.8x against 0.9
    assert rows[("N 1000 B 3", "spherical[atomic] fwd+bwd", "SDPA fwd+bwd")].target is None
    small, large = (7, 5, 3, 2), (9, 9, 9, 9)
    poly = [(small, "eager", 0, 0, 0.9), (small, "compiled", 0, 0, 0.6), (small, "floor", 0, 0, 0.1),
            (small, "ncd (main)", 0, 0, 0.2), (small, "ncd (other)", 0, 0, 0.3), (large, "eager", 0, 0, 4.0),
            (large, "ncd (main)", 0, 0, 2.0)]
    got = [(r.shape, r.variant, r.baseline, r.ratio, r.target) for r in results.polykan_rows(poly, "ncd (main)", large)]
    assert got == [("(7, 5, 3, 2)", "ncd (main) fwd+bwd", "eager fwd+bwd", pytest.approx(4.5), 3.0),
                   ("(7, 5, 3, 2)", "ncd (main) fwd+bwd", "compiled fwd+bwd", pytest.approx(3.0), 3.0),
                   ("(7, 5, 3, 2)", "ncd (other) fwd+bwd", "compiled fwd+bwd", pytest.approx(2.0), None),
                   ("(9, 9, 9, 9)", "ncd (main) fwd+bwd", "eager fwd+bwd", 2.0, 1.5)]
    gka = results.gka_rows([{"T": 64, "r": 10, "fwd_kernels": 0.3, "gdn_kernels": 0.15, "fb": 1.0, "naive_fb": 70.0}])
    assert [(r.baseline, r.ratio, r.met) for r in gka] == [("fla GDN fwd (kernel time)", 0.5, False),
                                                           ("naive recurrence fwd+bwd", 70.0, True)]
    assert results.device_name("device: NVIDIA H200, 132 SMs | torch 2.11") == "NVIDIA H200, 132 SMs"


def test_compare_json_is_the_old_against_new_table(results, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # compare.py imports results.py from beside itself
    compare = _load("compare")
    logs = tmp_path / "logs"
    logs.mkdir()
    for side, ms in (("old", 1.0), ("new", 1.05)):
        lines = [json.dumps({"n": 99, "batch": 3, "causal": False, "impl": impl, "mode": "fwd", "ms": value})
                 for impl, value in (("spherical", ms), ("sdpa", 2.0))]
        (logs / f"attention.{side}.1.log").write_text("device=NVIDIA H100 80GB HBM3 torch=2.13\n" + "\n".join(lines)
                                                      + "\ncorrectness OK\n")
    (tmp_path / "trees.json").write_text(json.dumps({"old": "637edd4", "new": "58d80ac"}))
    out = tmp_path / "compare.json"
    argv = ["--workdir", str(tmp_path), "--families", "attention", "--report-only", "--json", str(out)]
    assert compare.main(argv) == 1  # the ncd row is 5% slower
    (run,) = results.read_results(out)
    assert (run.family, run.device, run.commit, run.against) == ("attention", "NVIDIA H100 80GB HBM3", "58d80ac",
                                                                 "637edd4")
    rows = {r.variant: r for r in run.rows}
    assert rows["spherical fwd"].ratio == pytest.approx(1 / 1.05) and rows["spherical fwd"].met is False
    assert rows["sdpa fwd"].times == "baseline" and rows["sdpa fwd"].target is None


def test_committed_results_are_the_logged_tables(results, tmp_path):
    """bench/results/*.json are what bench/log_results.py reads out of bench/log/ (no number typed by hand), and
    the ratios agree with the ones the logged tables print beside their times."""
    log_results = _load("log_results")
    log_results.main(["--out", str(tmp_path)])
    for family in FAMILIES:
        fresh = results.read_results(tmp_path / f"{family}.json")
        assert fresh == results.read_results(BENCH / "results" / f"{family}.json"), (
            f"bench/results/{family}.json differs from the log: run python bench/log_results.py")
    text = log_results.LOG_2022.read_text()
    header, body = log_results.table_after(text, "**Attention bench of the final code**")
    stated = [log_results.number(c) for row in body for h, c in zip(header, row, strict=True) if h == "ratio"]
    (attention, _) = results.read_results(tmp_path / "attention.json")
    assert [round(r.ratio, 2) for r in attention.rows] == pytest.approx(stated, abs=0.011)
    header, body = log_results.table_after(text, "**Targets** (fwd+bwd of the default ncd layer")
    best = {row[0]: log_results.number(row[3]) for row in body}
    polykan = results.read_results(tmp_path / "polykan.json")[0]
    assert len(best) == 4
    for shape, ratio in best.items():  # against the best baseline: the least of the default layer's ratios
        ours = min(r.ratio for r in polykan.rows if r.shape == shape and r.variant == "ncd (LUT) fwd+bwd")
        assert ours == pytest.approx(ratio, abs=0.006)


def test_plot_without_matplotlib_says_what_to_install(tmp_path, monkeypatch, results):
    plot = _load("plot")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    path = results.write_results(tmp_path / "a.json", _run(results))
    with pytest.raises(SystemExit, match=r"needs matplotlib.*pip install"):
        plot.main([str(path)])


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_plot_writes_one_small_png_per_family(results, tmp_path):
    """Skipped without matplotlib (CI does not install it; it is the optional `bench` extra)."""
    pytest.importorskip("matplotlib")
    plot = _load("plot")
    first = results.write_results(tmp_path / "one.json", _run(results))
    second = results.write_results(tmp_path / "two.json", [
        _run(results, title="new code against old", against="637edd4"),
        results.Run(family="gka", device="H100", date="2026-11-22", commit="94559ac", rows=[
            results.Row("T 64 r 10", "ncd fwd+bwd", "naive recurrence fwd+bwd", 1.0, 12690.0, target=50.0),
            results.Row("T 64 r 10", "ncd fwd", "fla GDN fwd", 1.0, 0.5)])])
    assert plot.main([str(first), str(second), "--out", str(tmp_path / "png")]) == 0
    pngs = sorted((tmp_path / "png").glob("*.png"))
    assert [p.name for p in pngs] == ["attention.png", "gka.png"]  # two runs of attention: one figure
    for png in pngs:
        width, height = _png_size(png)
        assert width == 900 and 200 < height < 2000
        assert png.stat().st_size < 150_000
    committed = sorted((BENCH / "results").glob("*.png"))
    assert [p.stem for p in committed] == sorted(FAMILIES)
    assert all(_png_size(p)[0] == 900 and p.stat().st_size < 150_000 for p in committed)
