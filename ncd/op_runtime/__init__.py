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

import functools
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["REGISTERED", "Arg", "KernelOp", "late", "op_module", "resolver"]

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


def _picker(positions: Sequence[int]) -> Callable[[Sequence[Any]], Sequence[Any]]:
    """`values -> the values at positions`, in order, as a C callable (operator.itemgetter; no Python frame): a
    tuple from a tuple."""
    if len(positions) >= 2:
        return operator.itemgetter(*positions)
    if len(positions) == 1:
        return operator.itemgetter(slice(positions[0], positions[0] + 1))
    return operator.itemgetter(slice(0, 0))


def _first_tensor(values: Sequence[Any]) -> torch.Tensor:
    for value in values:  # a loop, not a generator: no frame per value (host time per call)
        if isinstance(value, torch.Tensor):
            return value
    raise ValueError("no tensor among the values")


def _filled(results: Sequence[torch.Tensor | None], like: Any) -> tuple[torch.Tensor, ...]:
    """None results as distinct empty tensors (custom-op outputs may not alias each other); `like` (a tensor, or
    a sequence whose first tensor is used) gives their device."""
    for t in results:  # a loop, not a generator: no frame per result (host time per call)
        if t is None:
            break
    else:
        return tuple(results)  # type: ignore[arg-type]
    if not isinstance(like, torch.Tensor):
        like = _first_tensor(like)
    return tuple([t if t is not None else like.new_empty(0) for t in results])


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
        # what the per-call paths would otherwise re-derive (host time: bench/host_cpu.py)
        self._all_tensors = len(self._tensor_positions) == len(self.args)
        self._no_grads = (False,) * len(self.args)
        self._tensor_slots = tuple((i, self._saved_slots[i]) for i in self._tensor_positions)
        self._pick_tensors, self._pick_constants = _picker(self._tensor_positions), _picker(self._constant_positions)
        self._pick_saved_results = _picker(self.save_results)
        # the arguments that take gradients come first: a default raw result, then None for the rest, per argument
        self._grads_lead = self._grad_positions == tuple(range(len(self._grad_positions)))
        self._no_gradients = (None,) * (len(self.args) - len(self._grad_positions))
        self._every_tensor = tuple(a.is_tensor for a in self.args)  # needs_input_grad when every tensor needs one
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
            return [g.contiguous() for g in _filled(raw, saved)]

        def fake_backward(grads: list, saved: list, *rest: Any) -> list[torch.Tensor]:
            # contiguous, as the real gradients are made: `empty_like` of a transposed input kept its strides, and
            # a compiled graph then viewed the real, contiguous gradient by them (tests/test_distributed_training.py)
            *constants, needs = rest
            raw = self._backward_fake(tuple(grads), tuple(saved), tuple(constants), tuple(needs))
            return [g.contiguous() for g in _filled(raw, saved)]

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
        if self.save_results:
            ctx.save_for_backward(*self._pick_tensors(inputs), *self._pick_saved_results(results))
        else:
            ctx.save_for_backward(*inputs if self._all_tensors else self._pick_tensors(inputs))
        # one attribute (each costs host time): the constant arguments; with several differentiable results, the
        # shapes of the zeros that the unused ones get as their gradient; the eager forward's stash
        ctx.ncd = (tuple(self._pick_constants(inputs)) if self._constant_positions else (),
                   [(t.shape, t.dtype, t.device) for t in results[:self.differentiable]]
                   if self.differentiable > 1 else None,
                   stash)

    def _gradients(self, backward: Launcher | None, ctx: Any, *grads: torch.Tensor | None) -> tuple:
        """One gradient per argument from the results' gradients: by `backward` (an eager call: this is the eager
        Function's backward, bound by functools.partial, one Python frame less per call), else by the backward
        custom op while torch.compile traces, else by the backward launcher."""
        if backward is not None and torch.is_grad_enabled():  # create_graph: the kernels' gradients are not
            raise RuntimeError(f"{self.spec_name}: double backward (create_graph=True) is not supported; the "
                               "kernels' gradients are not differentiable")
        constants, result_meta, stash = ctx.ncd
        if len(grads) != self.differentiable:
            grads = tuple(grads[:self.differentiable])
        if result_meta is not None:
            grads = tuple(g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
                          for g, (shape, dtype, device) in zip(grads, result_meta, strict=True))
        saved = ctx.saved_tensors
        needs = ctx.needs_input_grad
        placeholders = False  # the backward custom op's results: an empty tensor where it had no gradient
        if backward is not None:
            raw = backward(grads, saved, constants, needs, stash)
        elif torch.compiler.is_compiling():
            raw = self.backward_op(list(grads), list(saved), *constants, list(needs))
            placeholders = True
        else:
            raw = self._backward(grads, saved, constants, needs, None)
        if self._to_arguments is not None:
            per_arg = tuple(self._to_arguments(tuple(raw), saved, constants, needs))
        elif self._grads_lead:
            per_arg = (*raw, *self._no_gradients)
        else:
            per_arg = tuple([None if slot is None else raw[slot] for slot in self._raw_slots])
        if not placeholders and needs == self._every_tensor:  # every tensor asked for a gradient (the usual case)
            return per_arg
        gradients: list[torch.Tensor | None] = [None] * len(per_arg)
        for i, slot in self._tensor_slots:  # constants have no gradient; tensors one where asked for
            if needs[i]:
                grad = per_arg[i]
                # an empty placeholder (a gradient the custom op had no tensor for) is no gradient
                if grad is not None and (not placeholders or grad.numel() or grad.shape == saved[slot].shape):
                    gradients[i] = grad
        return tuple(gradients)

    def _autograd_backward(self, ctx: Any, *grads: torch.Tensor | None) -> tuple:
        return self._gradients(None, ctx, *grads)

    def eager_function(self, eager_forward: Launcher | None = None, backward: Launcher | None = None
                       ) -> type[torch.autograd.Function]:
        """An autograd.Function running the launchers without the custom ops' dispatch, with the custom op's
        context and gradient mapping. A family may pass other launchers for the same arguments and results (an
        eager variant reading another layout); by default the op's own."""
        op = self
        run_forward = eager_forward or self._eager_forward
        plain_forward = self._forward
        run_backward = backward or self._backward
        single = len(self.results) == 1

        class Function(torch.autograd.Function):
            """Eager calls: the launchers without the custom ops' dispatch, the custom op's context and backward."""

            @staticmethod
            def forward(ctx: Any, *args: Any) -> Any:
                if run_forward is None:
                    results, stash = plain_forward(*args), None
                else:
                    results, stash = run_forward(ctx.needs_input_grad, *args)
                if single:
                    output = results[0]
                    if output is None:
                        output = _first_tensor(args).new_empty(0)
                else:
                    output = _filled(results, args)
                op._setup_context(ctx, args, output, stash)
                return output

            backward = staticmethod(functools.partial(op._gradients, run_backward))  # (ctx, *grads)

        Function.__name__ = Function.__qualname__ = f"{self.spec_name}_Function"
        return Function

    # --- the call ---------------------------------------------------------------------------------------------

    def needs_grad(self, args: Sequence[Any]) -> bool:
        return torch.is_grad_enabled() and any(
            isinstance(args[i], torch.Tensor) and args[i].requires_grad for i in self._grad_positions)

    def __call__(self, *args: Any) -> Any:
        if torch.compiler.is_compiling():
            return self.forward_op(*args)
        if torch.is_grad_enabled():  # needs_grad, inline (host time per call)
            for i in self._grad_positions:
                if isinstance(args[i], torch.Tensor) and args[i].requires_grad:
                    return self.Function.apply(*args)
        if self._eager_forward is not None:
            results = self._eager_forward(self._no_grads, *args)[0]
        else:
            results = self._forward(*args)
        if len(self.results) == 1 and results[0] is not None:
            return results[0]
        return self._single(_filled(results, args))


def late(namespace: Mapping[str, Any], name: str) -> Launcher:
    """`namespace[name]` looked up at each call: a generated module's launcher, which tests and `ncd check`
    replace on the module (a sabotaged kernel must reach the op)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return namespace[name](*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.late = (namespace, name)  # type: ignore[attr-defined]  # for `resolver`
    return call


def resolver(launcher: Launcher) -> Callable[[], Launcher]:
    """`resolver(launcher)()` is the function to call now: for a `late` launcher, `namespace[name]` at this moment,
    else the launcher. The resolver is made of C callables (functools.partial of a bound `__getitem__`), so
    `resolver(f)()(*args)` runs no Python frame besides the launcher's own: one frame less per call than `late`'s
    wrapper (host time per call: bench/host_cpu.py)."""
    namespace, name = getattr(launcher, "late", (None, None))
    if namespace is not None:
        return functools.partial(namespace.__getitem__, name)
    return functools.partial((launcher,).__getitem__, 0)


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
