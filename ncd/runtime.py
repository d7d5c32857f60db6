"""Call-time checks shared by every generated op: shapes by axis, dtypes, devices (the custom ops, autograd and
eager paths they guard are ncd/op_runtime's).

Generated modules pass static tables (each input's axes; each axis's fixed size or split factors) and get
back the size of every axis, or a `CallError` that names the tensor and the axis."""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from collections.abc import Mapping, Sequence

import torch

from .errors import CallError

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def bind_axes(
    axes: Mapping[str, tuple[int | None, tuple[str, ...]]],
    tensors: Sequence[tuple[str, torch.Tensor, tuple[str, ...]]],
) -> dict[str, int]:
    """Sizes of all axes seen in `tensors`; `axes[name] = (fixed size or None, split factors)`."""
    sizes: dict[str, int] = {}
    seen_in: dict[str, str] = {}
    for name, tensor, tensor_axes in tensors:
        if not isinstance(tensor, torch.Tensor):
            raise CallError(None, detail=f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != len(tensor_axes):
            raise CallError(None, detail=f"{name} must have {len(tensor_axes)} dims [{' '.join(tensor_axes)}], "
                            f"got shape {tuple(tensor.shape)}")
        for axis, n in zip(tensor_axes, tensor.shape, strict=True):
            fixed = axes[axis][0]
            if fixed is not None and n != fixed:
                raise CallError(None, detail=f"{name}: axis '{axis}' has size {n}, but the spec fixes it at {fixed}")
            if axis in sizes and sizes[axis] != n:
                raise CallError(None, detail=f"{name}: axis '{axis}' has size {n}, but {seen_in[axis]} has "
                                f"{sizes[axis]}")
            sizes[axis] = int(n)
            seen_in.setdefault(axis, name)
    for axis, (_, factors) in axes.items():
        if not factors or axis not in sizes:
            continue
        known = [f for f in factors if f in sizes or axes[f][0] is not None]
        product = 1
        for f in known:
            product *= sizes.get(f) or axes[f][0] or 1
        if len(known) == len(factors):
            if product != sizes[axis]:
                raise CallError(None, detail=f"{seen_in[axis]}: axis '{axis}' = {' * '.join(factors)} has size "
                                f"{sizes[axis]}, but the factors give {product}")
        elif len(known) == len(factors) - 1:
            rest = next(f for f in factors if f not in known)
            if product == 0:  # an empty factor: the axis is empty too, and the other factor is free
                if sizes[axis]:
                    raise CallError(None, detail=f"{seen_in[axis]}: axis '{axis}' ({sizes[axis]}) is not a multiple "
                                    f"of {' * '.join(known)} (0)")
                continue
            if sizes[axis] % product:
                raise CallError(None, detail=f"{seen_in[axis]}: axis '{axis}' ({sizes[axis]}) is not a multiple "
                                f"of {' * '.join(known)} ({product})")
            sizes[rest] = sizes[axis] // product
    return sizes


def check_floats(tensors: Sequence[tuple[str, torch.Tensor]], same_dtype: bool = True) -> torch.dtype:
    first = tensors[0]
    for name, t in tensors:
        if t.dtype not in FLOAT_DTYPES:
            raise CallError(None, detail=f"{name} has dtype {t.dtype}; expected float16, bfloat16 or float32")
        if same_dtype and t.dtype != first[1].dtype:
            raise CallError(None, detail=f"{name} has dtype {t.dtype} but {first[0]} has {first[1].dtype}")
    return first[1].dtype


def check_device(tensors: Sequence[tuple[str, torch.Tensor]]) -> torch.device:
    first = tensors[0]
    for name, t in tensors:
        if t.device.type == "meta":
            raise CallError(None, detail=f"{name} is a meta tensor (a shape without data); ncd kernels need tensors "
                            "with data on a CUDA device (or on the CPU under TRITON_INTERPRET=1)")
    for name, t in tensors:
        if t.device != first[1].device:
            raise CallError(None, detail=f"{name} is on {t.device} but {first[0]} is on {first[1].device}")
    device = first[1].device
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise CallError(None, detail=f"{first[0]} is on the CPU; ncd kernels run on CUDA devices "
                        "(or on the CPU under TRITON_INTERPRET=1)")
    return device


class CheckMemo:
    """What an op's call-time checks derived (axis sizes, a dtype), remembered per call signature: the shape, dtype
    and device of every tensor argument, all that `bind_axes`, `check_floats` and `check_device` read. A call whose
    signature passed before skips them (host time per call: bench/host_cpu.py). Failed checks are never
    remembered, so every bad call still raises its CallError; at most `limit` signatures are kept."""

    __slots__ = ("entries", "limit")

    def __init__(self, limit: int = 256) -> None:
        self.entries: dict[tuple, object] = {}
        self.limit = limit

    @staticmethod
    def signature(*tensors: torch.Tensor | None) -> tuple | None:
        """The call's signature; None (nothing to remember) when an argument is not a tensor or None."""
        try:
            return tuple([None if t is None else (t.shape, t.dtype, t.device) for t in tensors])
        except AttributeError:
            return None

    def get(self, signature: tuple | None) -> object:
        found = None if signature is None else self.entries.get(signature)
        if type(found) is _OnTheCpu:  # valid only while TRITON_INTERPRET is what it was (check_device reads it)
            return found.value if os.environ.get("TRITON_INTERPRET") == found.interpret else None
        return found

    def put(self, signature: tuple | None, value: object) -> None:
        if signature is None:
            return
        if len(self.entries) >= self.limit:  # shapes streaming by: start over rather than grow
            self.entries.clear()
        if any(s is not None and s[2].type == "cpu" for s in signature):
            value = _OnTheCpu(value, os.environ.get("TRITON_INTERPRET"))
        self.entries[signature] = value


@dataclasses.dataclass(frozen=True)
class _OnTheCpu:
    """A remembered CPU signature: CPU tensors pass check_device only under the interpreter."""

    value: object
    interpret: str | None


def scalar_input(name: str, value: object, differentiable: bool = False) -> float | torch.Tensor:
    """A scalar input as a float: a real number, or a one-element tensor that needs no gradient (the kernels take
    scalars as constants). `differentiable`: a one-element tensor that needs a gradient comes back as a 0-dim
    tensor, for the op to route its gradient (see `differentiable_scale`)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise CallError(None, detail=f"{name} must be a number or a one-element tensor, got a tensor of shape "
                            f"{tuple(value.shape)}")
        if value.device.type == "meta":
            raise CallError(None, detail=f"{name} is a meta tensor (no value); pass a number")
        if differentiable and value.requires_grad and torch.is_grad_enabled():
            return value.reshape(())
        check_constant(name, value, "a scalar input")
        return float(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise CallError(None, detail=f"{name} must be a number or a one-element tensor, got {type(value).__name__}")
    return float(value)


def check_constant(name: str, value: torch.Tensor, what: str) -> None:
    """A CallError when `value` would need a gradient the kernels do not compute."""
    if value.requires_grad and torch.is_grad_enabled():
        raise CallError(None, detail=f"{name} requires grad, but the kernels treat {what} as a constant and compute "
                        f"no gradient for it; pass {name}.detach() (or compute its gradient outside the op)")


class ZeroResult(torch.autograd.Function):
    """zeros(shape) that depends on `inputs` with zero gradients: what an op returns for empty batches, heads or
    sequences (no kernel launches on empty grids)."""

    @staticmethod
    def forward(ctx, shape, like, *inputs):  # type: ignore[override]
        ctx.shapes = [(t.shape, t.dtype, t.device) if isinstance(t, torch.Tensor) else None for t in inputs]
        return like.new_zeros(shape)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        zeros = [torch.zeros(s[0], dtype=s[1], device=s[2]) if s is not None else None for s in ctx.shapes]
        return (None, None, *zeros)


def zero_result(shape: Sequence[int], like: torch.Tensor, *inputs: torch.Tensor | None) -> torch.Tensor:
    return ZeroResult.apply(tuple(shape), like, *inputs)


def differentiable_scale(scale: float | torch.Tensor, q: torch.Tensor, name: str) -> tuple[float, torch.Tensor]:
    """(the score's scale as a float, q). Where the scale is a tensor that needs a gradient, q comes back times
    scale / float(scale), which is exactly 1, so the kernels see the same q; autograd then gives the scale
    dL/dscale = sum(q * dL/dq) / scale, the identity that s = scale (q . k) implies for every form of the kernels."""
    if not isinstance(scale, torch.Tensor):
        return float(scale), q
    value = float(scale.detach())
    if value == 0.0 or not math.isfinite(value):
        raise CallError(None, detail=f"{name} gives the score a scale of {value}, where the op cannot recover its "
                        f"gradient; pass {name}.detach() or a float")
    return value, q * (scale / value).to(q.dtype)
