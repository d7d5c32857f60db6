"""Write bench/results/<family>.json from the same-run tables that BENCHMARKS.md cites, parsed out of bench/log/.

    python bench/log_results.py [--out bench/results]    then    python bench/plot.py bench/results/*.json

The numbers are read from the logged markdown tables (and, for the rational MLP blocks, the logged sentence), not
typed here; what is typed is where each table is (a line just above it), what run it was (device, date, commit as
the log states them) and which column is which. The rows are made by the same functions as the bench scripts'
`--json` (bench/results.py), so targets and ratios mean the same in both.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

try:
    import results
except ImportError:  # imported from elsewhere (the tests): bench/ is not on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import results

ROOT = Path(__file__).resolve().parent.parent
LOG_2022 = ROOT / "bench" / "log" / "2026-11-20-to-22.md"
LOG_ISSUE31 = ROOT / "bench" / "log" / "2026-11-26-issue31.md"
ISSUE31 = {"date": "2026-11-26", "commit": "58d80ac", "against": "637edd4"}


# ----------------------------------------------------------------------------------------------- markdown


def section(text: str, anchor: str, name: str = "") -> str:
    """`text` from the line holding `anchor` on (the log's tables follow the sentence that names their run)."""
    at = text.find(anchor)
    if at < 0:
        raise SystemExit(f"{name or 'log'}: no line with {anchor!r}; the log moved, update bench/log_results.py")
    return text[text.rfind("\n", 0, at) + 1:]


def table_after(text: str, anchor: str, name: str = "") -> tuple[list[str], list[list[str]]]:
    """The first markdown table after `anchor`: (header cells, body rows), `**` and backticks stripped."""
    lines = section(text, anchor, name).splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("|")), None)
    if start is None:
        raise SystemExit(f"{name}: no table after {anchor!r}")
    block = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        block.append([cell.strip().replace("**", "").replace("`", "") for cell in line.strip().strip("|").split("|")])
    header, body = block[0], [row for row in block[1:] if not all(set(c) <= set("-: ") for c in row)]
    return header, body


def number(cell: str) -> float | None:
    """The cell's leading number ("0.370 (743)" -> 0.37, "12,690x" -> 12690, "85.3%" -> 85.3); None for "-"."""
    match = re.match(r"\s*(-?[\d,]*\.?\d+)", cell)
    return float(match[1].replace(",", "")) if match else None


def columns(header: list[str], body: list[list[str]], carry: tuple[str, ...] = ()) -> list[dict[str, str]]:
    """Rows as {first header of that name: cell}; an empty cell in a `carry` column repeats the one above."""
    rows: list[dict[str, str]] = []
    last: dict[str, str] = {}
    for cells in body:
        row: dict[str, str] = {}
        for name, cell in zip(header, cells, strict=True):
            row.setdefault(name, cell)
        for name in carry:
            row[name] = row[name] or last.get(name, "")
        last = row
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------------------------- families


class CompareRow(NamedTuple):  # what bench/results.compare_rows reads of bench/compare.py's rows
    family: str
    shape: str
    old: float | None
    new: float | None
    ours: bool


def compare_table(text: str, anchor: str, name: str) -> list[CompareRow]:
    """A table that bench/compare.py printed: family | shape | measurement | times | old ms | new ms | new/old."""
    return [CompareRow(r["family"], f"{r['shape']} | {r['measurement']}", number(r["old ms"]), number(r["new ms"]),
                       r["times"] == "ncd") for r in columns(*table_after(text, anchor, name))]


def old_vs_new(family: str, text: str, anchor: str, device: str, source: str, **meta: str) -> results.Run:
    rows = results.compare_rows(compare_table(text, anchor, source), threshold=0.03)[family]
    return results.Run(family=family, device=device, rows=rows, title="new code against old, same run",
                       source=source, ratio_label=results.OLD_OVER_NEW, **{**ISSUE31, **meta})


def attention(log22: str, log31: str) -> list[results.Run]:
    anchor = "**Attention bench of the final code**"
    native = []
    for r in columns(*table_after(log22, anchor, LOG_2022.name)):
        for impl, prefix in (("spherical", "sph"), ("sdpa", "SDPA"), ("softmax", "softmax")):
            for mode, suffix in (("fwd", "fwd"), ("fwdbwd", "f+b")):
                native.append({"n": int(r["N"]), "batch": int(r["B"]), "causal": r["causal"] == "yes", "impl": impl,
                               "mode": mode, "ms": number(r[f"{prefix} {suffix}"])})
    vs_sdpa = results.Run(family="attention", device="H100", date="2026-11-22", commit="cf469fa",
                          rows=results.attention_rows(native), title="ncd against SDPA (bf16, D 128, 16 heads)",
                          source=f"bench/log/{LOG_2022.name}: {anchor.strip('*')}")
    return [vs_sdpa, old_vs_new("attention", log31, "## Attention (", "NVIDIA H200",
                                f"bench/log/{LOG_ISSUE31.name}: Attention")]


RATIONAL_NAMES = {
    "forward, ncd": "fwd ncd", "forward, FlashKAT-style": "fwd FlashKAT-style", "forward, KAT-style": "fwd KAT-style",
    "forward, eager": "fwd eager", "backward, ncd atomic": "bwd ncd atomic",
    "backward, ncd deterministic": "bwd ncd deterministic", "backward, FlashKAT-style": "bwd FlashKAT-style",
    "backward, KAT-style, full shape, 1 run": "bwd KAT-style full (1 run)",
    "forward + backward, ncd with autograd": "fwd+bwd ncd (autograd)",
    "forward + backward, eager autograd": "fwd+bwd eager (autograd)",
}
RATIONAL_MLP = {  # bench/rational.py's MLP rows: the logged sentence that holds each pair of times
    ("MLP fp32 KATGroup", "MLP fp32 GELU"): r"fp32 KATGroup (\d+\.\d+) ms vs GELU (\d+\.\d+) ms",
    ("MLP bf16 autocast KATGroup", "MLP bf16 autocast GELU"):
        r"bf16\s+autocast with the default in-register upcast (\d+\.\d+) vs (\d+\.\d+) ms",
    ("MLP bf16 autocast KATGroup fp32 copy",): r"with KAT's fp32 copy \([^)]*\) (\d+\.\d+)",
}


def rational(log22: str, log31: str) -> list[results.Run]:
    anchor = "### Final run (the shipped code, 2026-11-21, H200)"
    text = section(log22, anchor, LOG_2022.name)
    table = columns(*table_after(log22, anchor, LOG_2022.name))
    ms = {RATIONAL_NAMES[r["measurement"]]: number(r["ms"]) for r in table if r["measurement"] in RATIONAL_NAMES}
    percent = {RATIONAL_NAMES[r["measurement"]]: value for r in table
               if r["measurement"] in RATIONAL_NAMES and (value := number(r["% of copy"])) is not None}
    for names, pattern in RATIONAL_MLP.items():
        match = re.search(pattern, text)
        if match is None:
            raise SystemExit(f"{LOG_2022.name}: no {pattern!r} after {anchor!r}")
        ms.update({name: float(value) for name, value in zip(names, match.groups(), strict=True)})
    shape = re.search(r"X = \[([\d, ]+)\] fp32, G = (\d+)", text)
    assert shape is not None
    vs = results.Run(family="rational", device="NVIDIA H200 (132 SMs)", date="2026-11-21", commit="not recorded",
                     rows=results.rational_rows(ms, percent, 100.0, f"X [{shape[1]}] fp32, G {shape[2]}",
                                                "MLP 384-1536-384, tokens [256, 197]"),
                     title="ncd against KAT, FlashKAT and eager", source=f"bench/log/{LOG_2022.name}: {anchor[4:]}")
    return [vs, old_vs_new("rational", log31, "## Group rational (", "NVIDIA H200",
                           f"bench/log/{LOG_ISSUE31.name}: Group rational")]


def polykan(log22: str, log31: str) -> list[results.Run]:
    anchor = "## Polynomial KAN (PolyKAN)"
    rows = [(tuple(int(v) for v in r["(B, Din, Dout, degree)"].strip("()").split(",")), r["variant"],
             number(r["fwd"]), number(r["bwd"]), number(r["fwd+bwd"]))
            for r in columns(*table_after(log22, anchor, LOG_2022.name), carry=("(B, Din, Dout, degree)",))]
    vs = results.Run(family="polykan", device="NVIDIA H200 (132 SMs)", date="2026-11-21", commit="not recorded",
                     rows=results.polykan_rows(rows, "ncd (LUT)", (4096, 1024, 1024, 8)),
                     title="ncd against the baselines, fwd+bwd (fp32)",
                     source=f"bench/log/{LOG_2022.name}: {anchor[3:]}")
    h200 = old_vs_new("polykan", log31, "## Polynomial KAN (`--no-sweep`)", "NVIDIA H200",
                      f"bench/log/{LOG_ISSUE31.name}: Polynomial KAN, one run per side")
    h100 = old_vs_new("polykan", log31, "## Polynomial KAN again: H100", "NVIDIA H100",
                      f"bench/log/{LOG_ISSUE31.name}: Polynomial KAN again, median of 3 runs per side")
    h100.title = "new code against old, same run, median of 3 runs per side"
    return [vs, h200, h100]


GKA_COLUMNS = {"T": "T", "r": "r", "fwd": "ncd fwd", "fb": "ncd f+b", "fb_tf32": "ncd f+b tf32-bwd",
               "chunked_fwd": "chunked fwd", "chunked_fb": "chunked f+b", "naive_fb": "naive f+b",
               "gdn": "fla GDN fwd", "fwd_kernels": "ncd fwd kernels", "gdn_kernels": "GDN fwd kernels"}


def gka(log22: str, log31: str) -> list[results.Run]:
    anchor = "**Full `bench/gka.py --ts 2048 --variants default` of 94559ac**"
    cells = [{key: number(r[column]) for key, column in GKA_COLUMNS.items()}
             for r in columns(*table_after(log22, anchor, LOG_2022.name))]
    cells = [{**cell, "T": int(cell["T"] or 0), "r": int(cell["r"] or 0)} for cell in cells]
    return [results.Run(family="gka", device="NVIDIA H100 80GB HBM3", date="2026-11-22", commit="94559ac",
                        rows=results.gka_rows(cells, ", B 4 H 8 D 128"),
                        title="ncd against fla GDN and references (bf16)",
                        source=f"bench/log/{LOG_2022.name}: Full bench/gka.py --ts 2048 --variants default of 94559ac")]


def generic(log22: str, log31: str) -> list[results.Run]:
    anchor = "## Generic family"
    text = section(log31, anchor, LOG_ISSUE31.name)
    block = text.split("```text", 1)[1].split("```", 1)[0]
    rows = [(name, mode, float(ours), float(theirs))
            for name, mode, ours, theirs, _ in (line.split() for line in block.strip().splitlines()[1:])]
    shapes = re.search(r"Shapes: ([^.]*)\.", text)
    assert shapes is not None, "the generic section names its shapes after 'Shapes:'"
    sizes = dict(part.strip().split(" ", 1) for part in " ".join(shapes[1].split()).split(";"))
    return [results.Run(family="generic", device="NVIDIA H200", date=ISSUE31["date"], commit=ISSUE31["commit"],
                        rows=results.generic_rows(rows, sizes),
                        title="the generic op against the same maths by hand (fp32)",
                        source=f"bench/log/{LOG_ISSUE31.name}: Generic family (bench/generic.py)")]


FAMILIES: dict[str, Callable[[str, str], list[results.Run]]] = {
    "attention": attention, "rational": rational, "polykan": polykan, "gka": gka, "generic": generic}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"), help="folder for FAMILY.json")
    args = parser.parse_args(argv)
    log22, log31 = LOG_2022.read_text(encoding="utf-8"), LOG_ISSUE31.read_text(encoding="utf-8")
    for family, read in FAMILIES.items():
        runs = read(log22, log31)
        path = results.write_results(Path(args.out) / f"{family}.json", runs)
        print(f"{path}: " + "; ".join(f"{run.title} ({run.device}, {run.date}, {len(run.rows)} rows)" for run in runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
