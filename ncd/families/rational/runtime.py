"""The group-rational family's op: y = F(x) per channel group, coefficients as parameters, on the shared runtime.

The generated module describes its input and parameters (axes, where each parameter's coefficients sit in the
kernels' gradient vector) and hands over its launchers `forward(x, params, groups)` and
`backward(dy, x, params, groups, deterministic) -> (dx, dc)`; `RationalOp` checks calls, lays x out as
[rows, channels] and splits dc into each parameter's gradient."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ncd import runtime as rt
from ncd.errors import CallError
from ncd.op_runtime import Arg, KernelOp, resolver

MODES = ("atomic", "deterministic")


@dataclass(frozen=True)
class Param:
    """A coefficient parameter: its spec axes, and where its coefficients sit in the kernels' gradient vector:
    slots [lo, hi) of each group's per-group block (group_pos: where the group axis is in its own shape) or of the
    shared block (group_pos None). `rest`: its shape without the group axis."""

    name: str
    axes: tuple[str, ...]
    lo: int
    hi: int
    rest: tuple[int, ...]
    group_pos: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "rest", tuple(self.rest))


class RationalOp:
    """`op(x, *params, accumulate=mode)`: checks, layout, then the kernels through the shared runtime."""

    def __init__(self, spec_name: str, op_id: str, *, x: str, x_axes: tuple[str, ...], params: Sequence[Param],
                 axes: Mapping[str, tuple[int | None, tuple[str, ...]]], group: str, k_group: int, k_shared: int,
                 forward: Callable[..., torch.Tensor], backward: Callable[..., tuple[torch.Tensor, torch.Tensor]],
                 x_perm: tuple[int, int] | None = None, out_perm: tuple[int, int] | None = None,
                 keyword: str = "accumulate") -> None:
        self.spec_name, self.x, self.x_axes, self.params = spec_name, x, x_axes, tuple(params)
        self.axes, self.group, self.k_group, self.k_shared = axes, group, k_group, k_shared
        self.x_perm, self.out_perm, self.keyword = x_perm, out_perm, keyword
        # the launchers to call now (a late() launcher is looked up at each call, without its wrapper's frame)
        self._forward_now, self._backward_now = resolver(forward), resolver(backward)
        self._checked = rt.CheckMemo()  # call signature -> group count, checks passed
        args = [Arg("x", grad=True), *(Arg(f"p{i}", grad=True) for i in range(len(self.params))),
                Arg("groups", "int"), Arg("deterministic", "bool")]
        self.op = KernelOp(f"ncd::{op_id}", spec_name, args, ["y"], forward=self._forward, fake=self._fake,
                           backward=self._backward, backward_fake=self._backward_fake, gradients=self._gradients)

    # --- launchers in the runtime's conventions ----------------------------------------------------------------

    def _forward(self, x: torch.Tensor, *rest: Any) -> tuple[torch.Tensor]:
        *params, groups, _ = rest
        return (self._forward_now()(x, tuple(params), groups),)

    @staticmethod
    def _fake(x: torch.Tensor, *rest: Any) -> tuple[torch.Tensor]:
        return (torch.empty_like(x, memory_format=torch.contiguous_format),)

    def _backward(self, grads: tuple, saved: tuple, constants: tuple, needs: tuple, stash: Any) -> tuple:
        (dy,) = grads
        if dy.stride(-1) != 1:
            dy = dy.contiguous()
        x, *params = saved
        groups, deterministic = constants
        return tuple(self._backward_now()(dy, x, tuple(params), groups, deterministic))

    def _backward_fake(self, grads: tuple, saved: tuple, constants: tuple, needs: tuple) -> list[torch.Tensor]:
        x = saved[0]
        n_out = constants[0] * self.k_group + self.k_shared
        return [torch.empty_like(x, memory_format=torch.contiguous_format),
                x.new_empty((n_out,), dtype=torch.float32)]

    def _gradients(self, raw: tuple, saved: tuple, constants: tuple, needs: tuple) -> tuple:
        """dx, then dc split into each parameter's gradient in its own layout and dtype."""
        dx, dc = raw
        groups = constants[0]
        per_group = dc[: groups * self.k_group].view(groups, self.k_group)
        shared = dc[groups * self.k_group:]
        grads = []
        for param, value in zip(self.params, saved[1:], strict=True):
            if param.group_pos is not None:
                grad = per_group[:, param.lo:param.hi].reshape(groups, *param.rest).movedim(0, param.group_pos)
            else:
                grad = shared[param.lo:param.hi].reshape(param.rest)
            grads.append(grad.to(value.dtype))
        return (dx, *grads, None, None)

    # --- the call -------------------------------------------------------------------------------------------

    def __call__(self, x: torch.Tensor, *params: torch.Tensor, accumulate: str) -> torch.Tensor:
        # torch.compile traces the checks themselves (no memo in the graph)
        signature = rt.CheckMemo.signature(x, *params) if (
            len(params) == len(self.params) and not torch.compiler.is_compiling()) else None
        groups = self._checked.get(signature)
        if groups is None:
            groups = self._check(x, params)
            self._checked.put(signature, groups)
        if accumulate not in MODES:
            raise CallError(None, detail=f"{self.keyword} must be 'atomic' or 'deterministic', got {accumulate!r}")
        if torch.is_autocast_enabled(x.device.type) and x.dtype != torch.float32:
            x = x.to(torch.float32)
        if self.x_perm is not None:
            x = x.permute(self.x_perm)
        if x.stride(-1) != 1:
            x = x.contiguous()
        y = self.op(x, *params, groups, accumulate == "deterministic")
        return y.permute(self.out_perm) if self.out_perm is not None else y

    def _check(self, x: torch.Tensor, params: tuple[torch.Tensor, ...]) -> int:
        """The call-time checks (remembered per signature in `_checked`); returns the group count."""
        named = [(self.x, x, self.x_axes), *((p.name, t, p.axes) for p, t in zip(self.params, params, strict=True))]
        sizes = rt.bind_axes(self.axes, named)
        rt.check_floats([(self.x, x)])
        rt.check_floats([(p.name, t) for p, t in zip(self.params, params, strict=True)], same_dtype=False)
        rt.check_device([(name, t) for name, t, _ in named])
        groups = sizes.get(self.group) or self.axes[self.group][0]
        if groups is None:
            raise CallError(None, detail=f"the group count '{self.group}' is not fixed by the spec nor carried by a "
                            "parameter")
        return groups
