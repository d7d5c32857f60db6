"""One results format for every bench script: what ncd ran against what, in one run on one machine, as JSON.

A bench script given `--json PATH` writes PATH with `write_results`; `bench/plot.py` draws one PNG per family from
such files; `bench/log_results.py` writes `bench/results/<family>.json` from the logged tables. The file:

    {"format": "ncd-bench-results/1",
     "runs": [{"family": "attention", "title": "ncd against the baselines", "device": "NVIDIA H100 80GB HBM3",
               "date": "2026-11-22", "commit": "cf469fa", "against": "", "source": "bench/attention.py ...",
               "ratio_label": "...",
               "rows": [{"shape": "N 1024 B 32 causal", "variant": "spherical fwd+bwd", "baseline": "SDPA fwd+bwd",
                         "ms": 1.592, "baseline_ms": 1.478, "ratio": 0.928, "target": 1.0, "times": "ncd"}]}]}

Every ratio reads the same way: baseline ms / ncd ms, how many times faster ncd's variant is than the baseline
(> 1: ncd faster). A target is the least ratio the family aims at (ratio >= target; "ncd within 1.5x of GDN's
time" is target 1/1.5). Where a comparison is not of two times (a fraction of the device's copy bandwidth) the row
carries its ratio and no baseline_ms. Old against new (`bench/compare.py`): the baseline is the old code, ms is the
new code's, and rows of code that is the same on both sides are `"times": "baseline"` (they show the run's noise).

The `*_rows` functions turn each bench script's own measurements into rows (the scripts import this module only
when `--json` is given, from beside themselves: `python bench/X.py` puts bench/ on sys.path).
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

FORMAT = "ncd-bench-results/1"
SPEEDUP = "baseline ms / ncd ms (> 1: ncd faster)"
OLD_OVER_NEW = "old ms / new ms (> 1: the new code is faster)"
WITHIN_3_PERCENT = 1 / 1.03  # issue 31: no kernel of the new code slower than the old by more than 3%


@dataclass(frozen=True)
class Row:
    shape: str
    variant: str  # what ncd runs ("spherical fwd+bwd"); old-vs-new: the measurement
    baseline: str  # what it is timed against ("SDPA fwd+bwd", "old code")
    ms: float | None  # ncd's time (old-vs-new: the new code's)
    baseline_ms: float | None
    ratio: float | None = None  # baseline_ms / ms unless given (a bandwidth fraction has no baseline_ms)
    target: float | None = None  # the least ratio aimed at, if the family states one
    times: str = "ncd"  # "ncd": ncd's own kernels; "baseline": the same code on both sides of an old-vs-new run

    def __post_init__(self) -> None:
        if self.ratio is None and self.ms and self.baseline_ms is not None:
            object.__setattr__(self, "ratio", self.baseline_ms / self.ms)
        if self.times not in ("ncd", "baseline"):
            raise ValueError(f"Row.times is 'ncd' or 'baseline', got {self.times!r}")

    @property
    def met(self) -> bool | None:
        """Whether the row reaches its target (None: no target or no ratio)."""
        return None if self.target is None or self.ratio is None else self.ratio >= self.target


@dataclass
class Run:
    family: str
    device: str
    date: str
    commit: str
    rows: list[Row] = field(default_factory=list)
    title: str = "ncd against the baselines"
    against: str = ""  # old-vs-new: the old code's commit
    source: str = ""  # the command, or the log section the numbers come from
    ratio_label: str = SPEEDUP


def run_to_dict(run: Run) -> dict:
    return {**{f.name: getattr(run, f.name) for f in fields(Run) if f.name != "rows"},
            "rows": [asdict(row) for row in run.rows]}


def run_from_dict(data: Mapping) -> Run:
    known = {f.name for f in fields(Run)} - {"rows"}
    unknown = set(data) - known - {"rows"}
    if unknown:
        raise ValueError(f"unknown run fields {sorted(unknown)} (known: {sorted(known)})")
    row_fields = {f.name for f in fields(Row)}
    rows = []
    for item in data.get("rows", []):
        extra = set(item) - row_fields
        if extra:
            raise ValueError(f"unknown row fields {sorted(extra)} in {item} (known: {sorted(row_fields)})")
        rows.append(Row(**item))
    return Run(**{k: data[k] for k in known if k in data}, rows=rows)


def write_results(path: str | os.PathLike, runs: Run | Sequence[Run]) -> Path:
    """Write one results file (parent folders made); returns its path."""
    runs = [runs] if isinstance(runs, Run) else list(runs)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"format": FORMAT, "runs": [run_to_dict(r) for r in runs]}, indent=1) + "\n",
                    encoding="utf-8")
    return path


def read_results(path: str | os.PathLike) -> list[Run]:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path}: not a bench results file (expected \"format\": \"{FORMAT}\")")
    return [run_from_dict(run) for run in data["runs"]]


def today() -> str:
    return datetime.datetime.now(datetime.timezone.utc).date().isoformat()


def current_commit(repo: str | os.PathLike | None = None) -> str:
    """HEAD of the checkout beside this file ("+ changes" when the tree differs from it); $NCD_COMMIT where there is
    no git history (a device machine's copy); else "unknown"."""
    repo = Path(repo) if repo else Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=False, timeout=10).stdout.strip()
        dirty = head and subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                                        capture_output=True, text=True, check=False, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        head = dirty = ""
    if head:
        return head + (" + changes" if dirty else "")
    return os.environ.get("NCD_COMMIT", "unknown")


TITLES = {"attention": "ncd against SDPA, eager and torch.compile", "rational": "ncd against KAT, FlashKAT and eager",
          "polykan": "ncd against the baselines, fwd+bwd", "gka": "ncd against fla GDN and the references",
          "generic": "the generic op against the same maths by hand, both torch.compile'd"}


def new_run(family: str, device: str, rows: Iterable[Row], **kw: str) -> Run:
    """A run measured now, of this checkout."""
    kw.setdefault("title", TITLES.get(family, Run.title))
    return Run(family=family, device=device, date=today(), commit=current_commit(), rows=list(rows), **kw)


# ----------------------------------------------------------------------------------------- the scripts' rows

_ATTENTION_NCD = ("spherical", "softmax", "spherical_streamed", "spherical_factorized")
_MODE = {"fwd": "fwd", "fwdbwd": "fwd+bwd"}


def attention_target(impl: str, mode: str, n: int) -> float | None:
    """BENCHMARKS.md's attention targets: spherical fwd+bwd >= 1.0x SDPA; softmax fwd >= 0.9x SDPA at N <= 4k."""
    if impl == "spherical" and mode == "fwdbwd":
        return 1.0
    if impl == "softmax" and mode == "fwd" and n <= 4096:
        return 0.9
    return None


def attention_rows(rows: Iterable[Mapping]) -> list[Row]:
    """bench/attention.py's rows ({n, batch, causal, impl, mode, ms}): each of ncd's implementations against SDPA,
    and the spherical ones against eager PyTorch and torch.compile of it, at the same shape and mode."""
    rows = list(rows)
    by = {(r["n"], r["batch"], r["causal"], r["impl"], r["mode"]): r.get("ms") for r in rows}
    out = []
    for r in rows:
        impl = r["impl"].split("[")[0]
        if impl not in _ATTENTION_NCD:
            continue
        key = (r["n"], r["batch"], r["causal"])
        shape = f"N {r['n']} B {r['batch']}{' causal' if r['causal'] else ''}"
        baselines = [("sdpa", "SDPA")]
        if impl.startswith("spherical"):
            baselines += [("compiled_spherical", "torch.compile(eager spherical)"), ("eager_spherical", "eager")]
        for base, label in baselines:
            if (*key, base, r["mode"]) in by:
                target = attention_target(r["impl"], r["mode"], r["n"]) if base == "sdpa" else None
                out.append(Row(shape, f"{r['impl']} {_MODE.get(r['mode'], r['mode'])}",
                               f"{label} {_MODE.get(r['mode'], r['mode'])}", r.get("ms"),
                               by[(*key, base, r["mode"])], target=target))
    return out


RATIONAL_VS = {  # ncd's row -> the baselines it is timed against (bench/rational.py's names)
    "fwd ncd": ("fwd FlashKAT-style", "fwd KAT-style", "fwd eager"),
    "bwd ncd atomic": ("bwd FlashKAT-style", "bwd KAT-style full (1 run)"),
    "bwd ncd deterministic": ("bwd FlashKAT-style",),
    "fwd+bwd ncd (autograd)": ("fwd+bwd eager (autograd)",),
}
RATIONAL_TARGETS = {("bwd ncd atomic", "bwd FlashKAT-style"): 1.2, "copy": 0.85, "MLP": 1 / 1.25}


def rational_rows(ms: Mapping[str, float | None], bandwidth: Mapping[str, float], copy_bandwidth: float,
                  shape: str, mlp_shape: str) -> list[Row]:
    """bench/rational.py's timings (name -> ms), bandwidths (name -> GB/s) and the device copy's GB/s: the kernels
    against each baseline and as a fraction of copy bandwidth; the MLP blocks with KATGroup against GELU."""
    out = []
    for ours, baselines in RATIONAL_VS.items():
        for base in baselines:
            if ms.get(ours) is not None and ms.get(base) is not None:
                out.append(Row(shape, ours, base, ms[ours], ms[base],
                               target=RATIONAL_TARGETS.get((ours, base))))
        if ours in bandwidth and copy_bandwidth:
            out.append(Row(shape, ours, "device copy bandwidth", ms.get(ours), None,
                           ratio=bandwidth[ours] / copy_bandwidth, target=RATIONAL_TARGETS["copy"]))
    for name, value in ms.items():
        if name.startswith("MLP ") and "KATGroup" in name:
            precision = name[len("MLP "):].split(" KATGroup")[0]
            gelu = ms.get(f"MLP {precision} GELU")
            if value is not None and gelu is not None:
                out.append(Row(mlp_shape, name, f"MLP {precision} GELU", value, gelu, target=RATIONAL_TARGETS["MLP"]))
    return out


def polykan_target(config: Sequence[int], large: Sequence[int]) -> float:
    """issue 5: the default layer's fwd+bwd >= 3x the best baseline at the paper configs, >= 1.5x at the large."""
    return 1.5 if tuple(config) == tuple(large) else 3.0


def polykan_rows(rows: Iterable[Sequence], main: str, large: Sequence[int]) -> list[Row]:
    """bench/polykan.py's rows (config, variant, fwd, bwd, fwd+bwd ms), fwd+bwd: the default layer (`main`) against
    every baseline, every other ncd variant against its config's best baseline. The floor row is no baseline."""
    rows = list(rows)
    out = []
    for config in dict.fromkeys(tuple(r[0]) for r in rows):
        here = [r for r in rows if tuple(r[0]) == config]
        baselines = [r for r in here if not r[1].startswith(("ncd", "floor"))]
        if not baselines:
            continue
        best = min(baselines, key=lambda r: r[4])
        for r in here:
            if not r[1].startswith("ncd"):
                continue
            for base in baselines if r[1] == main else [best]:
                target = polykan_target(config, large) if r[1] == main else None
                out.append(Row(str(config), f"{r[1]} fwd+bwd", f"{base[1]} fwd+bwd", r[4], base[4], target=target))
    return out


def gka_target(r: int) -> float | None:
    """issue 6: ncd's forward kernels within 1.5x of fla GDN's at r 10, 3x at r 30."""
    return {10: 1 / 1.5, 30: 1 / 3}.get(r)


GKA_VS = (  # (ncd's cell, baseline's cell, ncd label, baseline label)
    ("fwd_kernels", "gdn_kernels", "ncd fwd (kernel time)", "fla GDN fwd (kernel time)"),
    ("fwd", "gdn", "ncd fwd", "fla GDN fwd"),
    ("fwd", "chunked_fwd", "ncd fwd", "chunked reference fwd"),
    ("fb", "chunked_fb", "ncd fwd+bwd", "chunked reference fwd+bwd"),
    ("fb", "naive_fb", "ncd fwd+bwd", "naive recurrence fwd+bwd"),
)
GKA_NAIVE_TARGET = 50.0  # issue 6: >= 50x the naive recurrence's fwd+bwd at T 2048


def gka_rows(cells: Iterable[Mapping], shape_suffix: str = "") -> list[Row]:
    """bench/gka.py's cells ({T, r, fwd, fb, fwd_kernels, gdn, gdn_kernels, chunked_fwd, ...}) as rows."""
    out = []
    for cell in cells:
        shape = f"T {cell['T']} r {cell['r']}{shape_suffix}"
        for ours, base, ours_label, base_label in GKA_VS:
            if cell.get(ours) is None or cell.get(base) is None:
                continue
            target = (gka_target(int(cell["r"])) if base == "gdn_kernels"
                      else GKA_NAIVE_TARGET if base == "naive_fb" else None)
            out.append(Row(shape, ours_label, base_label, float(cell[ours]), float(cell[base]), target=target))
    return out


def generic_rows(rows: Iterable[Sequence], sizes: Mapping[str, Mapping[str, int] | str] | None = None) -> list[Row]:
    """bench/generic.py's rows (spec, pass, generic ms, hand ms): the generic op against the same maths written by
    hand and torch.compile'd; `sizes`: spec -> its axis sizes, for the shape's name."""
    def shape(name: str) -> str:
        size = (sizes or {}).get(name)
        text = ", ".join(f"{k} {v}" for k, v in size.items()) if isinstance(size, Mapping) else size
        return f"{name} ({text})" if text else name

    return [Row(shape(str(name)), f"generic {mode}", f"hand-written, compiled {mode}", ours, theirs)
            for name, mode, ours, theirs in rows]


def compare_rows(rows: Iterable, threshold: float) -> dict[str, list[Row]]:
    """bench/compare.py's rows (family, shape "SHAPE | MEASUREMENT", old, new, ours) per family: the new code against
    the old; ncd's rows carry the target 1 / (1 + threshold)."""
    out: dict[str, list[Row]] = {}
    for row in rows:
        shape, _, measurement = row.shape.rpartition(" | ")
        out.setdefault(row.family, []).append(
            Row(shape or "-", measurement, "old code", row.new, row.old,
                target=1 / (1 + threshold) if row.ours else None, times="ncd" if row.ours else "baseline"))
    return out


def device_name(line: str) -> str:
    """The device out of a bench's first line ("device: NVIDIA H200, 132 SMs | torch ...", "device=NVIDIA H100 80GB
    HBM3 torch=2.11 ...", "device NVIDIA H100 80GB HBM3, torch 2.11, 2026-11-22 12:57")."""
    name = re.sub(r"^device\s*[=:]?\s*", "", line.strip(), flags=re.I)
    return re.split(r"\s*\|\s*|,?\s+torch[=\s]", name, maxsplit=1)[0].strip(" ,") or line


def compare_runs(rows: Iterable, threshold: float, devices: Mapping[str, str], labels: Mapping[str, str],
                 source: str = "bench/compare.py") -> list[Run]:
    """One old-vs-new run per family from bench/compare.py's combined rows; `devices`: family -> the device line its
    bench printed; `labels`: side ("old", "new") -> the tree's commit label."""
    return [Run(family=family, device=device_name(devices.get(family, "unknown")), date=today(),
                commit=labels.get("new", "unknown"), rows=family_rows, title="new code against old, same run",
                against=labels.get("old", "unknown"), source=source, ratio_label=OLD_OVER_NEW)
            for family, family_rows in compare_rows(rows, threshold).items()]
