"""Call-time checks shared by every generated op: shapes by axis, dtypes, devices.

Generated modules pass static tables (each input's axes; each axis's fixed size or split factors) and get
back the size of every axis, or a `CallError` that names the tensor and the axis."""

from __future__ import annotations

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
        if t.device != first[1].device:
            raise CallError(None, detail=f"{name} is on {t.device} but {first[0]} is on {first[1].device}")
    device = first[1].device
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise CallError(None, detail=f"{first[0]} is on the CPU; ncd kernels run on CUDA devices "
                        "(or on the CPU under TRITON_INTERPRET=1)")
    return device
