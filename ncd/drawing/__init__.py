"""`ncd draw`: a spec as its neural circuit diagram (diagram.py builds it from the verified IR, marks.py adds what
the plan decided, render.py lays it out and writes SVG or PNG)."""

from __future__ import annotations

from ncd.drawing.diagram import PlanMarks, diagram
from ncd.pipeline import FrontEnd

STAGES = ("ir", "plan")
FORMATS = ("svg", "png")


def draw_spec(front: FrontEnd, stage: str = "plan", fmt: str = "svg") -> bytes:
    """The spec's diagram as SVG (UTF-8) or PNG bytes; stage "plan" also marks what the compiler decided (and
    raises the usual located error where no family compiles the spec)."""
    from ncd.drawing.render import to_png, to_svg

    if stage not in STAGES or fmt not in FORMATS:
        raise ValueError(f"stage is one of {STAGES} and format one of {FORMATS}, not {stage!r}, {fmt!r}")
    marks = None
    title = f"spec {front.program.name}   ({front.source.filename})"
    if stage == "plan":
        from ncd.compiler import compile_front
        from ncd.drawing.marks import plan_marks

        selection = compile_front(front, until="select").selection
        marks = plan_marks(front.program, selection.family.name, selection.plan)
    svg = to_svg(diagram(front.program, marks), title)
    return svg.encode("utf-8") if fmt == "svg" else to_png(svg)


__all__ = ["FORMATS", "STAGES", "PlanMarks", "diagram", "draw_spec"]
