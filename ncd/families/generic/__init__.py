"""The generic kernel family: any verified spec as a PyTorch function that torch.compile lowers to Triton."""

from .plan import GenericPlan, plan_generic

__all__ = ["GenericPlan", "plan_generic"]
