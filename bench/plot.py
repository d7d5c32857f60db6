"""Draw benchmark results: one PNG per family from bench/results.py's JSON files.

    python bench/plot.py bench/results/*.json [--out DIR]

Needs matplotlib (`pip install -e '.[bench]'`); only this script does. Each family's runs, from every file given,
go into one figure, one panel per run (titled with its device, date and commit): a horizontal bar per row from the
line at 1.0 to its ratio (baseline ms / ncd ms, > 1: ncd faster; old against new: old ms / new ms), grouped by
shape, coloured by whether the row meets its target (green) or not (red), blue where the family states no target,
grey for rows that time the same code on both sides of an old-against-new run (the run's noise); each target is a
dark tick across its bar. The figures are 900 px wide (GitHub's page width). PNG files go to DIR (default: the
folder of the first file) as FAMILY.png.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

try:
    from results import Row, Run, read_results
except ImportError:  # imported from elsewhere (the tests): bench/ is not on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from results import Row, Run, read_results

WIDTH_IN, DPI = 9.0, 100  # 900 px
ROW_IN = 0.2  # height of one bar's line
PANEL_EXTRA_IN = 1.0  # a panel's title and x axis
PALETTE = 64  # colours kept in the PNG (flat-coloured charts: a tenth of the bytes of full colour)
COLOURS = {"met": "#4c9a5b", "missed": "#c44e52", "no target": "#4c72b0", "noise": "#b0b0b0"}
TARGET_COLOUR = "#222222"
LABEL_CHARS = 76
PASSES = ("fwd", "bwd", "fwd+bwd", "fwdbwd")  # a variant's last word, when it names the pass timed
FAMILY_NAMES = {"attention": "Attention", "rational": "Group rational (KAT)", "polykan": "Polynomial KAN",
                "gka": "Gated KalmaNet", "generic": "Generic family"}


def require_matplotlib() -> Any:
    """matplotlib with the Agg backend, or a clear exit."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("bench/plot.py needs matplotlib, which the project does not require: "
                         "pip install matplotlib (or pip install -e '.[bench]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def status(row: Row) -> str:
    if row.times == "baseline":
        return "noise"
    return {None: "no target", True: "met", False: "missed"}[row.met]


def short_baseline(row: Row) -> str:
    """The baseline without the pass it shares with the variant ("SDPA fwd+bwd" beside "spherical fwd+bwd")."""
    mode = row.variant.rsplit(" ", 1)[-1]
    shared = mode in PASSES and row.baseline.endswith(" " + mode)
    return row.baseline[: -len(mode) - 1] if shared else row.baseline


def common_mode(rows: Sequence[Row]) -> str:
    """The pass every row's variant ends with ("fwd+bwd"), if there is one and more than one row."""
    modes = {row.variant.rsplit(" ", 1)[-1] if " " in row.variant else "" for row in rows}
    return modes.pop() if len(modes) == 1 and len(rows) > 1 and modes <= set(PASSES) else ""


def row_label(row: Row, one_baseline: bool, mode: str) -> str:
    """"variant vs baseline"; without the variant's pass where the whole panel shares it, and without the baseline
    where the panel has one (both named in the axis label)."""
    label = row.variant[: -len(mode) - 1] if mode else row.variant
    if not one_baseline:
        label += f" vs {short_baseline(row)}"
    return "\n".join(textwrap.wrap(label, LABEL_CHARS, max_lines=2, placeholder="..."))


def panel_lines(run: Run) -> list[tuple[str, Row | None]]:
    """The panel's lines top to bottom: each shape's header, then its rows (in the run's order)."""
    shapes: dict[str, list[Row]] = {}
    for row in run.rows:
        shapes.setdefault(row.shape, []).append(row)
    lines: list[tuple[str, Row | None]] = []
    for shape, rows in shapes.items():
        lines.append((shape, None))
        lines += [("", row) for row in rows]
    return lines


def x_range(run: Run) -> tuple[float, float, bool]:
    """(low, high, log scale) covering 1.0, every ratio and target, with room for the value labels."""
    values = [1.0] + [v for row in run.rows for v in (row.ratio, row.target) if v is not None and v > 0]
    low, high = min(values), max(values)
    if high / low > 8:
        return low / 1.6, high * 3.5, True
    span = max(high - low, 0.02)
    return max(0.0, low - 0.05 * span), high + 0.22 * span, False


def value_text(ratio: float) -> str:
    """Three decimals near 1.0 (old against new, where 3% decides), two elsewhere, none past 100."""
    if ratio >= 100:
        return f"{ratio:,.0f}x"
    return f"{ratio:.3f}x" if abs(ratio - 1.0) < 0.1 else f"{ratio:.2f}x"


def draw_panel(ax: Any, run: Run) -> set[str]:
    """One run's bars on `ax`; returns the colour keys used (for the legend)."""
    lines = panel_lines(run)
    one_baseline = len({short_baseline(row) for row in run.rows}) == 1
    mode = common_mode(run.rows)
    low, high, log = x_range(run)
    used: set[str] = set()
    labels = []
    for y, (header, row) in enumerate(lines):
        if row is None:
            labels.append(header)
            continue
        labels.append(row_label(row, one_baseline, mode))
        if row.ratio is None:
            ax.text(1.0, y, "  not measured", va="center", fontsize=7, color="#555555")
            continue
        key = status(row)
        used.add(key)
        ax.barh(y, row.ratio - 1.0, left=1.0, height=0.7, color=COLOURS[key])
        anchor = max(row.ratio, 1.0, row.target or 0.0)  # the value right of the bar, the 1.0 line and the target
        ax.text(anchor * 1.04 if log else anchor, y, value_text(row.ratio) if log else f" {value_text(row.ratio)}",
                va="center", ha="left", fontsize=7)
        if row.target is not None:
            ax.plot([row.target, row.target], [y - 0.45, y + 0.45], color=TARGET_COLOUR, lw=2.2,
                    solid_capstyle="butt")
    ax.axvline(1.0, color="#444444", lw=0.9, zorder=0)
    if log:
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(_ratio_formatter())
    ax.set_xlim(low, high)
    ax.set_ylim(len(lines) - 0.5, -0.6)
    ax.set_yticks(range(len(lines)), labels, fontsize=7.5)
    for tick, (_, row) in zip(ax.get_yticklabels(), lines, strict=True):
        if row is None:
            tick.set_fontweight("bold")
    ax.tick_params(axis="y", length=0)
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(axis="x", color="#e4e4e4", lw=0.6, zorder=0)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    xlabel = run.ratio_label + (f"; baseline: {short_baseline(run.rows[0])}" if one_baseline and run.rows else "")
    ax.set_xlabel(xlabel + (f"; every row {mode}" if mode else ""), fontsize=8)
    against = f" against {run.against}" if run.against else ""
    title = f"{run.title}: {run.device}, {run.date}, commit {run.commit}{against}"
    ax.set_title("\n".join(textwrap.wrap(title, 80)), fontsize=9)
    return used


def _ratio_formatter() -> Any:
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda x, _: f"{x:g}x" if x >= 1 else f"{x:.2g}x")


def plot_family(family: str, runs: Sequence[Run], path: str | Path) -> Path:
    """One PNG of `runs` (one panel each) at `path`."""
    plt = require_matplotlib()
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    heights = [ROW_IN * max(len(panel_lines(run)), 2) + PANEL_EXTRA_IN for run in runs]
    legend_in = 0.75
    fig, axes = plt.subplots(len(runs), 1, figsize=(WIDTH_IN, sum(heights) + legend_in), dpi=DPI,
                             gridspec_kw={"height_ratios": heights}, layout="constrained", squeeze=False)
    used: set[str] = set()
    for ax, run in zip(axes[:, 0], runs, strict=True):
        used |= draw_panel(ax, run)
    names = {"met": "meets its target", "missed": "misses its target", "no target": "no target stated",
             "noise": "same code both sides (noise)"}
    handles: list[Any] = [Patch(color=COLOURS[k], label=names[k]) for k in COLOURS if k in used]
    if any(row.target is not None for run in runs for row in run.rows):
        handles.append(Line2D([], [], color=TARGET_COLOUR, lw=2.2, label="target (least ratio aimed at)"))
    fig.suptitle(FAMILY_NAMES.get(family, family), fontsize=12, fontweight="bold")
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 5), fontsize=8, frameon=False)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    shrink_png(path)
    return path


def shrink_png(path: Path) -> None:
    """Rewrite the PNG with a small palette (Pillow comes with matplotlib)."""
    from PIL import Image

    with Image.open(path) as image:
        small = image.convert("RGB").quantize(PALETTE, method=Image.Quantize.FASTOCTREE)
    small.save(path, optimize=True)


def by_family(runs: Sequence[Run]) -> dict[str, list[Run]]:
    families: dict[str, list[Run]] = {}
    for run in runs:
        families.setdefault(run.family, []).append(run)
    return families


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", help="results files (bench/results.py's format)")
    parser.add_argument("--out", help="folder for FAMILY.png (default: the first file's folder)")
    args = parser.parse_args(argv)
    require_matplotlib()
    runs = [run for name in args.files for run in read_results(name)]
    out = Path(args.out) if args.out else Path(args.files[0]).parent
    for family, family_runs in by_family(runs).items():
        path = plot_family(family, family_runs, out / f"{family}.png")
        size = path.stat().st_size
        print(f"{path}: {len(family_runs)} panel(s), {sum(len(r.rows) for r in family_runs)} bars, "
              f"{size / 1024:.0f} KB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
