"""The plan's decisions as diagram marks (diagram.PlanMarks): the family, the streamed axis and its state, the
kernels and the definitions each computes."""

from __future__ import annotations

from ncd import ir
from ncd.drawing.diagram import PlanMarks


def plan_marks(program: ir.Program, family: str, plan: object) -> PlanMarks:
    """Every specialised family compiles the whole spec as one op (its kernels fused over all definitions); the
    generic family runs each definition as its own torch expression. Attention streams over the certificate's
    axis with its state; the recurrences scan their scan's axis, keeping the scanned tensors as state."""
    names = tuple(d.tensor for d in program.definitions)
    kernels: tuple[tuple[str, tuple[str, ...]], ...]
    if family == "generic":
        kernels = tuple((f"generic: torch ops for {name}", (name,)) for name in names)
    else:
        kernels = ((f"{family}: one fused op", names),)
    certificate = getattr(plan, "certificate", None)
    if certificate is not None:
        return PlanMarks(family, certificate.axis, tuple(certificate.state), kernels)
    scans = [(d.tensor, node.over) for d in program.definitions for node in ir.walk(d.value)
             if isinstance(node, ir.Scan)]
    if scans and family != "generic":
        return PlanMarks(family, scans[0][1], tuple(dict.fromkeys(t for t, _ in scans)), kernels)
    return PlanMarks(family, kernels=kernels)
