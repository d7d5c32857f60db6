"""The polynomial-KAN family's op: y[b o] = sum_{i d} P_d(x[b i]) c[d i o] on the shared runtime.

The kernels take x as [batch, in] and the coefficients as [degree, in, out] (the kernel layout), fp32. The
generated module hands over its launchers `forward_impl(x, c, O, need_dx, need_dc) -> (y, saved)` and
`backward_impl(dy, x, c, O, need_dx, need_dc, saved) -> (dx, dc)`, and where the spec's axes sit. `PolyKANOp`
checks a call once per (shapes, coefficient strides, dtypes, devices) and remembers the route it found:

- direct: fp32 coefficients whose storage already is the kernel layout are read in place (the gradient comes back
  as the same view of a kernel-layout tensor);
- convert: fp32 coefficients in another layout are copied to the kernel layout inside the autograd function (one
  copy, no autograd node for it);
- general: anything else is converted by PyTorch (tracked by autograd) and goes through the kernel-layout op,
  whose custom ops torch.compile traces."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ncd import runtime as rt
from ncd.errors import CallError
from ncd.op_runtime import Arg, KernelOp, resolver


def _permuted(t: torch.Tensor, perm: tuple[int, ...] | None) -> torch.Tensor:
    return t if perm is None else t.permute(perm)


def _identity_or(perm: tuple[int, ...]) -> tuple[int, ...] | None:
    return None if tuple(perm) == tuple(range(len(perm))) else tuple(perm)


class PolyKANOp:
    """`op(x, c)`: the spec's input and coefficient tensor in their spec layouts; returns the output in its spec
    layout, in the inputs' dtype."""

    def __init__(self, spec_name: str, op_id: str, *, x: str, x_axes: tuple[str, ...], c: str,
                 c_axes: tuple[str, ...], axes: Mapping[str, tuple[int | None, tuple[str, ...]]], batch: str,
                 inp: str, outp: str, degrees: int, forward_impl: Callable[..., Any],
                 backward_impl: Callable[..., Any], c_perm: tuple[int, int, int], out_perm: tuple[int, int]) -> None:
        self.spec_name, self.x, self.x_axes, self.c, self.c_axes = spec_name, x, tuple(x_axes), c, tuple(c_axes)
        self.axes, self.batch, self.inp, self.outp, self.degrees = axes, batch, inp, outp, degrees
        self._forward_impl, self._backward_impl = forward_impl, backward_impl
        # the launchers to call now, found without late()'s wrapper frame (hot paths below)
        self._forward_now, self._backward_now = resolver(forward_impl), resolver(backward_impl)
        self.x_perm = _identity_or(tuple(self.x_axes.index(a) for a in (batch, inp)))
        self.x_direct = self.x_perm is None
        self.c_perm = _identity_or(c_perm)  # spec layout -> kernel layout [degree inp outp]
        self.grad_perm = _identity_or(tuple(c_perm.index(k) for k in range(3)))  # kernel layout -> spec layout
        self.o_axis = self.c_axes.index(outp)
        self.out_perm = _identity_or(out_perm)
        self._routes: dict[tuple, bool] = {}  # call signature -> direct (True) or convert (False), checks done
        args = [Arg("x", grad=True), Arg("c", grad=True)]
        self.op = KernelOp(f"ncd::{op_id}", spec_name, args, ["y"], forward=self._forward, fake=self._fake,
                           eager_forward=self._eager_forward(2, None), backward=self._backward(2, None),
                           backward_fake=self._backward_fake)
        self._direct = self.op.eager_function(self._eager_forward(self.o_axis, None),
                                              self._backward(self.o_axis, self.grad_perm))
        self._convert = self.op.eager_function(self._eager_forward(2, self.c_perm), self._backward(2, self.grad_perm))

    # --- launchers in the runtime's conventions ----------------------------------------------------------------

    def _forward(self, x: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor]:
        return (self._forward_impl(x, c, c.shape[2])[0],)

    @staticmethod
    def _fake(x: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor]:
        return (x.new_empty((x.shape[0], c.shape[2]), dtype=torch.float32),)

    def _eager_forward(self, o_axis: int, convert: tuple[int, ...] | None) -> Callable[..., Any]:
        """The forward of eager calls: `c`'s storage is the kernel layout and o_axis its out axis, or (`convert`)
        `c` is copied to the kernel layout here. The stash keeps the kernel-layout c and the forward's
        intermediates for the backward."""

        def eager_forward(needs: tuple[bool, ...], x: torch.Tensor, c: torch.Tensor) -> tuple:
            if convert is not None:
                c = c.permute(convert).contiguous()
            y, saved = self._forward_now()(x, c, c.shape[o_axis], needs[0], needs[1])
            return (y,), (c, saved)

        return eager_forward

    def _backward(self, o_axis: int, grad_perm: tuple[int, ...] | None) -> Callable[..., Any]:
        def backward(grads: tuple, saved: tuple, constants: tuple, needs: tuple, stash: Any) -> tuple:
            (dy,) = grads
            x, c = saved
            c, kept = stash if stash is not None else (c, None)
            dx, dc = self._backward_now()(dy, x, c, c.shape[o_axis], needs[0], needs[1], kept)
            if dc is not None and grad_perm is not None:
                dc = dc.permute(grad_perm)
            return dx, dc

        return backward

    @staticmethod
    def _backward_fake(grads: tuple, saved: tuple, constants: tuple, needs: tuple) -> list[torch.Tensor]:
        x, c = saved
        return [x.new_empty(x.shape if needs[0] else (0,), dtype=torch.float32),
                c.new_empty(c.shape if needs[1] else (0,), dtype=torch.float32)]

    # --- the call -------------------------------------------------------------------------------------------

    def _out(self, y: torch.Tensor) -> torch.Tensor:
        return _permuted(y, self.out_perm)

    def __call__(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            route = self._routes.get((x.shape, c.shape, c.stride(), x.dtype, c.dtype, x.device, c.device))
            if route is not None and x.is_contiguous():
                grad = torch.is_grad_enabled() and (x.requires_grad or c.requires_grad)
                if not route:  # fp32 coefficients in another layout (a contiguous spec-layout parameter)
                    if grad:
                        y = self._convert.apply(x, c)
                    else:
                        kernel_c = (c if self.c_perm is None else c.permute(self.c_perm)).contiguous()
                        y = self._forward_now()(x, kernel_c, kernel_c.shape[2])[0]
                elif grad:
                    y = self._direct.apply(x, c)
                else:
                    y = self._forward_now()(x, c, c.shape[self.o_axis])[0]
                return y if self.out_perm is None else y.permute(self.out_perm)  # _out, inline (host time per call)
        return self._general(x, c)

    def _general(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """Checks, then the direct path (recorded in _routes) or conversion to the kernel layouts."""
        sizes = rt.bind_axes(self.axes, [(self.x, x, self.x_axes), (self.c, c, self.c_axes)])
        dtype = rt.check_floats([(self.x, x), (self.c, c)])
        rt.check_device([(self.x, x), (self.c, c)])
        b, i, o = sizes[self.batch], sizes[self.inp], sizes[self.outp]
        if max(self.degrees * i * o, b * self.degrees * i, b * o) >= 2**31:
            raise CallError(None, detail=f"{self.spec_name}: tensors too large for the kernels' 32-bit offsets")
        if self.x_direct and not torch.compiler.is_compiling() and x.dtype == c.dtype == torch.float32:
            key = (x.shape, c.shape, c.stride(), x.dtype, c.dtype, x.device, c.device)
            # direct: the coefficients' storage already is the kernel layout, read without a copy; convert: other
            # strides (a contiguous spec-layout parameter), copied inside the autograd function on later calls
            self._routes[key] = _permuted(c, self.c_perm).is_contiguous()
            if x.is_contiguous():
                return self(x, c)
        # kernel layouts: x as [batch in], the coefficients as [degree in out] (copies, tracked by autograd)
        kernel_x = _permuted(x, self.x_perm).to(torch.float32).contiguous()
        kernel_c = _permuted(c, self.c_perm).to(torch.float32).contiguous()
        return self._out(self.op(kernel_x, kernel_c)).to(dtype)
