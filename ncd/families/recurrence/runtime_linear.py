"""The gated linear attention op on the shared runtime, with fla's conventions (chunk_gla's positional order).

The generated module hands over its launchers `forward(q, k, v, g, s_init, cu_seqlens, scale, chunk, final) ->
(o, s_fin)`, `backward(do, ds_fin, q, k, v, g, s_init, cu_seqlens, scale, chunk) -> (dq, dk, dv, dg, ds_init)`
and `step(q, k, v, g, s_init, scale) -> (o, s_fin)` (kernel_linear.py). Calls are checked and scales
resolved as for Gated KalmaNet (runtime.py's GKAOp, whose checks this op shares); non-finite inputs need no guard
here: the kernels put NaN where the recurrence does (kernel_linear.py)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ncd import runtime as rt
from ncd.errors import CallError
from ncd.families.recurrence.runtime import Roles, ScanOp, as_head_first, as_one_head_sequences
from ncd.op_runtime import Arg, KernelOp

_ARGS = [Arg("q", grad=True), Arg("k", grad=True), Arg("v", grad=True), Arg("g", grad=True),
         Arg("s_init", "Tensor?", grad=True), Arg("cu_seqlens", "Tensor?"), Arg("scale", "float"),
         Arg("chunk", "int"), Arg("final", "bool")]


class LinearScanOp(ScanOp):
    """`chunk(...)` (training and prefill), `recurrent(...)` (decoding) and `call_spec` for gated linear
    attention: S_t = exp(g_t) S_(t-1) + k_t v_t^T, o_t = scale S_t^T q_t, one state S [N, H, K, V] fp32. The delta
    rule's op (runtime_delta.py) shares its construction and state layout, with its own arguments (ARGS)."""

    ARGS = _ARGS

    def __init__(self, spec_name: str, op_id: str, *, roles: Roles, axes: Mapping[str, tuple[int | None, tuple]],
                 forward: Callable[..., Any], backward: Callable[..., Any], chunk_table: Callable[..., Any],
                 step: Callable[..., Any], output_factor: float,
                 scale_default: Callable[[dict[str, int]], float | None], chunk_size: int,
                 eager_forward: Callable[..., Any] | None = None) -> None:
        """eager_forward (optional): `(needs, *args) -> ((o, s_fin), stash)`, a forward whose stash (e.g. GLA's
        chunk scores) the eager backward receives as the backward launcher's last argument."""
        self.spec_name, self.roles, self.axes = spec_name, roles, axes
        self.chunk_size = chunk_size
        self._checked = rt.CheckMemo()
        self._launch_forward, self._launch_backward, self._chunk_table = forward, backward, chunk_table
        self._launch_step = step
        self.output_factor, self.scale_default = output_factor, scale_default
        self.op = KernelOp(f"ncd::{op_id}", spec_name, self.ARGS, ["o", "s_fin"], differentiable=2,
                           forward=self._forward, fake=self._fake, backward=self._backward,
                           backward_fake=self._backward_fake, eager_forward=eager_forward)

    def _forward(self, *args: Any) -> tuple:
        return self._launch_forward(*args)

    @staticmethod
    def _fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, s_init: Any, cu_seqlens: Any,
              scale: float, chunk: int, final: bool) -> tuple:
        n_seq = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        shape = (n_seq, q.shape[2], q.shape[3], v.shape[3]) if final else (0,)
        return v.new_empty((*q.shape[:3], v.shape[3])), q.new_empty(shape, dtype=torch.float32)

    def _backward(self, grads: tuple, saved: tuple, constants: tuple, needs: tuple, stash: Any) -> list:
        do, ds_fin = grads
        q, k, v, g, s_init, cu_seqlens = saved
        scale, chunk, _ = constants
        # (the kernels read the final state's gradient as a contiguous [N, H, K, V]: a slice of a wider one, or a
        # transposed one, arrives strided)
        ds_fin = ds_fin.contiguous() if ds_fin is not None and ds_fin.numel() > 0 else None
        kept = () if stash is None else (stash,)
        return list(self._launch_backward(do, ds_fin, q, k, v, g, s_init, cu_seqlens, scale, chunk, *kept))

    @staticmethod
    def _backward_fake(grads: tuple, saved: tuple, constants: tuple, needs: tuple) -> list:
        q = saved[0]
        return [torch.empty_like(t) if t is not None else q.new_empty(0) for t in saved[:5]]

    def _per_token(self, g: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """A gate per head (RetNet: g[head]) as the kernels' gate per token, a broadcast view (autograd sums its
        gradient back); a gate per token as given."""
        if not self.roles.gate_per_head:
            return g
        if self.roles.head_first:
            return g.view(1, -1, 1).expand(q.shape[0], q.shape[1], q.shape[2])
        return g.view(1, 1, -1).expand(*q.shape[:3])

    @staticmethod
    def _state_shapes(initial_state: Any, n_seq: int, heads: int, K: int, V: int) -> list:
        return [("initial_state", initial_state, (n_seq, heads, K, V), "sequence head key value")]

    def chunk(self, q: Any, k: Any, v: Any, g: Any, scale: Any = None,  # type: ignore[override]
              initial_state: Any = None, output_final_state: bool = False, cu_seqlens: Any = None, *,
              chunk_size: int | None = None) -> tuple:
        """The chunked op in fla's chunk_gla positional order (q, k, v, g, scale, initial_state,
        output_final_state, cu_seqlens). q, k [B, T, H, K], v [B, T, H, V], g [B, T, H] (or all head-first, [B,
        H, T, ...], where the spec declares them so; no cu_seqlens then; k and v with H / G heads where the spec
        splits `head = kvhead * group`) natural-log gates (<= 0;
        -inf is a full reset). scale: a number or a one-element tensor (its gradient is computed when it requires
        one); None takes the spec's default. initial_state: S [N, H, K, V] fp32 or None. Returns (o [B, T, H, V],
        final state [N, H, K, V] fp32 or None). Non-finite inputs: the outputs are non-finite exactly where the
        recurrence's are (the kernels keep a token's NaN from earlier rows of its chunk), the gradients at least
        there; double backward raises."""
        chunk_size = self.chunk_size if chunk_size is None else chunk_size
        self._check_presence(q, k, v, g, None, None, scale)
        sizes = self._check(q, k, v, g, None, None, initial_state, cu_seqlens, chunk_size)
        scale, scale_tensor = self._kernel_scale(scale, sizes)
        s_init = initial_state.float().contiguous() if initial_state is not None else None
        g = self._per_token(g, q)
        shape = None
        if self.roles.head_first:  # [B, H, T, D] is [B * H, T, 1, D]: B * H sequences of one head
            (q, k, v, g), (s_init,), shape = as_one_head_sequences((q, k, v, g), (s_init,))
        o, s_fin = self.op(q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), s_init, cu_seqlens,
                           float(scale), int(chunk_size), bool(output_final_state))
        if shape is not None:
            o, (s_fin,) = as_head_first(o, (s_fin,), shape)
        if scale_tensor is not None:
            o = o * scale_tensor.to(o.dtype)
        return o, (s_fin if output_final_state else None)

    def recurrent(self, q: Any, k: Any, v: Any, g: Any, scale: Any = None,  # type: ignore[override]
                  initial_state: Any = None, output_final_state: bool = True) -> tuple:
        """Decoding: the recurrence token by token from a state (fla's fused_recurrent convention), typically one
        token per call after a prefill by `chunk(..., output_final_state=True)`. Arguments as `chunk`'s (no
        cu_seqlens: one state per batch entry, S [B, H, K, V] fp32 or None). Returns (o [B, T, H, V], the state
        after the last token or None). Inference only: inputs that require a gradient are refused."""
        self._check_presence(q, k, v, g, None, None, scale)
        sizes = self._check(q, k, v, g, None, None, initial_state, None, self.chunk_size)
        if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                           for t in (q, k, v, g, scale, initial_state)):
            raise CallError(None, detail=f"{self.spec_name}: recurrent() is for decoding and has no backward; an "
                            "input requires a gradient (use chunk() to train, or call under torch.no_grad())")
        scale = float(self._scale(scale, sizes)) * self.output_factor
        g = self._per_token(g, q)
        shape = None
        if self.roles.head_first:
            (q, k, v, g), (initial_state,), shape = as_one_head_sequences((q, k, v, g), (initial_state,))
        o, s_fin = self._launch_step(q, k, v, g, initial_state, scale)
        if shape is not None:
            o, (s_fin,) = as_head_first(o, (s_fin,), shape)
        return o, (s_fin if output_final_state else None)
