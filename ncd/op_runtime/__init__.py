"""One op runtime: a pair of kernel launchers (forward, backward) as one differentiable PyTorch op.

A family's generated op part describes its op (the arguments with their types and which take gradients, the
results, the launchers from the kernel part, what the backward reads) and `KernelOp` does the rest, the same way
for every family:

- two `torch.library.custom_op`s, `ncd::<op id>` and `ncd::<op id>_backward`, with fake (meta) implementations
  and the forward's autograd registered; torch.compile traces these;
- an eager `torch.autograd.Function` that calls the launchers without the custom ops' dispatch (which costs host
  time on every call: 60-190 us a forward on the H100 machine, bench/log/2026-11-20-to-22.md), sharing the custom
  op's context and backward so that the two paths cannot drift apart;
- `KernelOp(*args)` picks the path: the custom op while torch.compile traces, the eager Function when a gradient
  is needed, the bare forward launcher otherwise.

Launcher conventions (all positional):

- `forward(*args) -> results`: one tensor (or None, which becomes an empty tensor) per declared result;
- `eager_forward(needs, *args) -> (results, stash)` (optional): the forward of eager calls, told which arguments
  need a gradient; `stash` (anything) reaches the eager backward (the custom op's backward gets None);
- `backward(grads, saved, constants, needs, stash) -> raw`: `grads` one per differentiable result (None where
  it got none), `saved` the tensor arguments in order (None for an absent optional one) then the saved results,
  `constants` the non-tensor arguments in order, `needs` one bool per argument;
- `gradients(raw, saved, constants, needs) -> one gradient per argument` (optional; default: `raw` holds one
  gradient per argument that takes one, in order), in PyTorch only (torch.compile traces it);
- `fake(*args)` and `backward_fake(grads, saved, constants, needs)`: results of the right shapes and dtypes.

`op_module` builds the family's `nn.Module`; ncd/runtime.py has the call-time checks (tensor and axis named)."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["REGISTERED", "Arg", "KernelOp", "late", "op_module"]

_TYPES = ("Tensor", "Tensor?", "float", "int", "bool")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class Arg:
    """One argument of a kernel op: its name, its schema type (Tensor, Tensor?, float, int, bool) and whether it
    takes a gradient."""

    name: str
    type: str = "Tensor"
    grad: bool = False

    def __post_init__(self) -> None:
        if self.type not in _TYPES:
            raise ValueError(f"argument {self.name!r}: type must be one of {_TYPES}, got {self.type!r}")
        if not _NAME.fullmatch(self.name):
            raise ValueError(f"argument name {self.name!r} is not an identifier")
        if self.grad and not self.is_tensor:
            raise ValueError(f"argument {self.name!r}: only tensors take gradients")

    @property
    def is_tensor(self) -> bool:
        return self.type.startswith("Tensor")


Launcher = Callable[..., Any]


def _schema(args: Sequence[Arg], n_results: int) -> str:
    results = "Tensor" if n_results == 1 else "(" + ", ".join(["Tensor"] * n_results) + ")"
    return "(" + ", ".join(f"{a.type} {a.name}" for a in args) + f") -> {results}"


def _backward_schema(args: Sequence[Arg]) -> str:
    constants = "".join(f", {a.type} {a.name}" for a in args if not a.is_tensor)
    return f"(Tensor?[] grads, Tensor?[] saved{constants}, bool[] needs) -> Tensor[]"


def _first_tensor(values: Sequence[Any]) -> torch.Tensor:
    return next(v for v in values if isinstance(v, torch.Tensor))


def _filled(results: Sequence[torch.Tensor | None], like: Any) -> tuple[torch.Tensor, ...]:
    """None results as distinct empty tensors (custom-op outputs may not alias each other); `like` (a tensor, or
    a sequence whose first tensor is used) gives their device."""
    if all(t is not None for t in results):
        return tuple(results)  # type: ignore[arg-type]
    if not isinstance(like, torch.Tensor):
        like = _first_tensor(like)
    return tuple(t if t is not None else like.new_empty(0) for t in results)


def _fitting(grad: torch.Tensor | None, like: torch.Tensor | None) -> torch.Tensor | None:
    """`grad` as the gradient of `like`; an empty placeholder (a gradient the custom op had no tensor for) is None."""
    if grad is None or like is None:
        return None
    if grad.numel() == 0 and grad.shape != like.shape:
        return None
    return grad


class KernelOp:
    """A kernel pair as one op: custom ops (`self.forward_op`, `self.backward_op`) with fakes and autograd, and the
    eager `self.Function`. Call it with the arguments in declared order; it returns the single result, or the
    tuple of results. `qualname` ("ncd::<op id>") must be unique in the process: custom ops are global."""

    def __init__(self, qualname: str, spec_name: str, args: Sequence[Arg], results: Sequence[str], *,
                 forward: Launcher, fake: Launcher, backward: Launcher, differentiable: int = 1,
                 save_results: Sequence[int] = (), eager_forward: Launcher | None = None,
                 backward_fake: Launcher | None = None, gradients: Launcher | None = None) -> None:
        if not qualname.startswith("ncd::") or not _NAME.fullmatch(qualname[5:]):
            raise ValueError(f"op names are 'ncd::<identifier>', got {qualname!r}")
        clashes = {a.name for a in args if not a.is_tensor} & {"grads", "saved", "needs"}
        if clashes:
            raise ValueError(f"constant arguments may not be named {sorted(clashes)}: the backward's schema uses them")
        if not 0 <= differentiable <= len(results):
            raise ValueError(f"{differentiable} differentiable results of {len(results)}")
        self.qualname, self.spec_name = qualname, spec_name
        self.args = tuple(args)
        self.results = tuple(results)
        self.differentiable = differentiable
        self.save_results = tuple(save_results)
        self._forward, self._eager_forward = forward, eager_forward
        self._backward, self._to_arguments = backward, gradients
        self._backward_fake = backward_fake or self._default_backward_fake
        self._tensor_positions = tuple(i for i, a in enumerate(self.args) if a.is_tensor)
        self._constant_positions = tuple(i for i, a in enumerate(self.args) if not a.is_tensor)
        self._grad_positions = tuple(i for i, a in enumerate(self.args) if a.grad)
        # per argument: its index among the saved tensors, and among the backward's default results (or None)
        self._saved_slots = tuple(self._tensor_positions.index(i) if a.is_tensor else None
                                  for i, a in enumerate(self.args))
        self._raw_slots = tuple(self._grad_positions.index(i) if a.grad else None for i, a in enumerate(self.args))
        self.forward_op = self._register_forward(fake)
        self.backward_op = self._register_backward()
        self.forward_op.register_autograd(self._autograd_backward, setup_context=self._setup_context)
        self.Function = self.eager_function()
        REGISTERED[qualname] = self

    # --- the custom ops --------------------------------------------------------------------------------------

    def _register_forward(self, fake: Launcher) -> Any:
        def forward(*args: Any) -> Any:
            return self._single(_filled(self._forward(*args), args))

        def fake_forward(*args: Any) -> Any:
            return self._single(_filled(fake(*args), args))

        op = torch.library.custom_op(self.qualname, forward, mutates_args=(),
                                     schema=_schema(self.args, len(self.results)))
        op.register_fake(fake_forward)
        return op

    def _register_backward(self) -> Any:
        def backward(grads: list, saved: list, *rest: Any) -> list[torch.Tensor]:
            *constants, needs = rest
            raw = self._backward(tuple(grads), tuple(saved), tuple(constants), tuple(needs), None)
            return list(_filled(raw, saved))

        def fake_backward(grads: list, saved: list, *rest: Any) -> list[torch.Tensor]:
            *constants, needs = rest
            raw = self._backward_fake(tuple(grads), tuple(saved), tuple(constants), tuple(needs))
            return list(_filled(raw, saved))

        op = torch.library.custom_op(f"{self.qualname}_backward", backward, mutates_args=(),
                                     schema=_backward_schema(self.args))
        op.register_fake(fake_backward)
        return op

    def _default_backward_fake(self, grads: tuple, saved: tuple, constants: tuple, needs: tuple) -> list:
        by_position = dict(zip(self._tensor_positions, saved, strict=False))
        like = _first_tensor(saved)
        return [torch.empty_like(by_position[i]) if needs[i] and by_position[i] is not None else like.new_empty(0)
                for i in self._grad_positions]

    def _single(self, results: tuple[torch.Tensor, ...]) -> Any:
        return results[0] if len(self.results) == 1 else results

    # --- autograd, shared by the custom op and the eager Function ----------------------------------------------

    def _setup_context(self, ctx: Any, inputs: Sequence[Any], output: Any, stash: Any = None) -> None:
        results = (output,) if len(self.results) == 1 else tuple(output)
        if len(results) > self.differentiable:  # statistics: no gradient, so no zero-filled buffers for them
            ctx.set_materialize_grads(False)
            ctx.mark_non_differentiable(*results[self.differentiable:])
        ctx.save_for_backward(*[inputs[i] for i in self._tensor_positions],
                              *[results[i] for i in self.save_results])
        ctx.constants = tuple([inputs[i] for i in self._constant_positions])
        # with several differentiable results, the unused ones get no gradient: zeros of these shapes
        ctx.result_meta = [(t.shape, t.dtype, t.device) for t in results[:self.differentiable]] \
            if self.differentiable > 1 else None
        ctx.stash = stash

    def _gradients(self, ctx: Any, grads: Sequence[torch.Tensor | None], backward: Launcher | None) -> tuple:
        """One gradient per argument from the results' gradients: by `backward` (an eager call), else by the
        backward custom op while torch.compile traces, else by the backward launcher."""
        grads = tuple(grads[:self.differentiable])
        if ctx.result_meta is not None:
            grads = tuple(g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
                          for g, (shape, dtype, device) in zip(grads, ctx.result_meta, strict=True))
        saved = ctx.saved_tensors
        needs = ctx.needs_input_grad
        if backward is not None:
            raw = backward(grads, saved, ctx.constants, needs, ctx.stash)
        elif torch.compiler.is_compiling():
            raw = self.backward_op(list(grads), list(saved), *ctx.constants, list(needs))
        else:
            raw = self._backward(grads, saved, ctx.constants, needs, None)
        if self._to_arguments is not None:
            per_arg = tuple(self._to_arguments(tuple(raw), saved, ctx.constants, needs))
        else:
            per_arg = tuple(None if slot is None else raw[slot] for slot in self._raw_slots)
        return tuple(_fitting(g, saved[slot]) if need and slot is not None else None
                     for g, need, slot in zip(per_arg, needs, self._saved_slots, strict=True))

    def _autograd_backward(self, ctx: Any, *grads: torch.Tensor | None) -> tuple:
        return self._gradients(ctx, grads, None)

    def eager_function(self, eager_forward: Launcher | None = None, backward: Launcher | None = None
                       ) -> type[torch.autograd.Function]:
        """An autograd.Function running the launchers without the custom ops' dispatch, with the custom op's
        context and gradient mapping. A family may pass other launchers for the same arguments and results (an
        eager variant reading another layout); by default the op's own."""
        op = self
        run_forward = eager_forward or self._eager_forward or (lambda needs, *args: (self._forward(*args), None))
        run_backward = backward or self._backward

        class Function(torch.autograd.Function):
            """Eager calls: the launchers without the custom ops' dispatch, the custom op's context and backward."""

            @staticmethod
            def forward(ctx: Any, *args: Any) -> Any:
                results, stash = run_forward(ctx.needs_input_grad, *args)
                output = op._single(_filled(results, args))
                op._setup_context(ctx, args, output, stash)
                return output

            @staticmethod
            def backward(ctx: Any, *grads: Any) -> Any:
                if torch.is_grad_enabled():  # create_graph: the kernels' gradients are not differentiable
                    raise RuntimeError(f"{op.spec_name}: double backward (create_graph=True) is not supported; the "
                                       "kernels' gradients are not differentiable")
                return op._gradients(ctx, grads, run_backward)

        Function.__name__ = Function.__qualname__ = f"{self.spec_name}_Function"
        return Function

    def _run_forward(self, needs: Sequence[bool], args: Sequence[Any]) -> tuple[torch.Tensor, ...]:
        if self._eager_forward is not None:
            results = self._eager_forward(tuple(needs), *args)[0]
        else:
            results = self._forward(*args)
        return _filled(results, args)

    # --- the call ---------------------------------------------------------------------------------------------

    def needs_grad(self, args: Sequence[Any]) -> bool:
        return torch.is_grad_enabled() and any(
            isinstance(args[i], torch.Tensor) and args[i].requires_grad for i in self._grad_positions)

    def __call__(self, *args: Any) -> Any:
        if torch.compiler.is_compiling():
            return self.forward_op(*args)
        if self.needs_grad(args):
            return self.Function.apply(*args)
        return self._single(self._run_forward((False,) * len(args), args))


def late(namespace: Mapping[str, Any], name: str) -> Launcher:
    """`namespace[name]` looked up at each call: a generated module's launcher, which tests and `ncd check`
    replace on the module (a sabotaged kernel must reach the op)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return namespace[name](*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    return call


REGISTERED: dict[str, KernelOp] = {}  # qualname -> op, every op registered in this process


def op_module(fn: Callable[..., Any], doc: str) -> type[torch.nn.Module]:
    """The op `fn` as an nn.Module class whose forward takes what `fn` takes; it belongs to `fn`'s module (where the
    generated module binds it as `Module`), so that pickle finds it there."""

    class Module(torch.nn.Module):
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return fn(*args, **kwargs)

    Module.__doc__ = doc
    Module.__module__ = fn.__module__
    return Module
