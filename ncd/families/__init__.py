"""The kernel-family registry: families are asked in this order; the first whose planner returns a plan compiles
the spec, and the generic family, last, takes every spec the others decline. Adding a family is one folder (its
planner, renderer and validation forms; see docs/architecture.md) and one line here."""

from __future__ import annotations

from ..family import Family

REGISTRY: tuple[Family, ...] = (
    Family("attention", "normalized-contraction attention: O = normalize(a(S), over key) . V with S = Q . K",
           "ncd.families.attention.plan:plan_attention", "ncd.families.attention.forms:AttentionForms"),
    Family("rational", "group-wise rational activations of one input (KAT / FlashKAT)",
           "ncd.families.rational.plan:plan_rational", "ncd.families.rational.forms:RationalForms"),
    Family("polykan", "polynomial KAN layers: a basis recurrence of one input contracted with coefficients",
           "ncd.families.polykan.plan:plan_polykan", "ncd.families.polykan.forms:PolyKANForms"),
    Family("recurrence", "gated outer-product recurrences: gated linear attention; Gated KalmaNet's ridge solve",
           "ncd.families.recurrence.plan:plan_recurrence", "ncd.families.recurrence.forms:RecurrenceForms"),
    Family("generic", "any other spec: a PyTorch function of its IR that torch.compile lowers to Triton",
           "ncd.families.generic:plan_generic", "ncd.families.generic.forms:GenericForms"),
)


def family(name: str) -> Family:
    return next(f for f in REGISTRY if f.name == name)
