"""The (gated) delta rule op on the shared runtime, with fla's conventions (chunk_gated_delta_rule's and
chunk_delta_rule's positional orders).

The generated module hands over its launchers `forward(q, k, v, g, beta, s_init, cu_seqlens, scale, chunk, final) ->
(o, s_fin)`, `backward(do, ds_fin, q, k, v, g, beta, s_init, cu_seqlens, scale, chunk) -> (dq, dk, dv, dg, dbeta,
ds_init)` and `step(q, k, v, g, beta, s_init, scale) -> (o, s_fin)` (kernel_delta.py); g is None for the delta rule
without a gate. Calls are checked and scales resolved as for the other recurrences (runtime.py's ScanOp);
non-finite inputs need no guard: the kernels put NaN where the recurrence does."""

from __future__ import annotations

from typing import Any

import torch

from ncd.errors import CallError
from ncd.families.recurrence.runtime import _per_query_head, as_head_first, as_one_head_sequences
from ncd.families.recurrence.runtime_linear import LinearScanOp
from ncd.op_runtime import Arg

CHUNK_SIZES = (16, 32, 64)
_ARGS = [Arg("q", grad=True), Arg("k", grad=True), Arg("v", grad=True), Arg("g", "Tensor?", grad=True),
         Arg("beta", grad=True), Arg("s_init", "Tensor?", grad=True), Arg("cu_seqlens", "Tensor?"),
         Arg("scale", "float"), Arg("chunk", "int"), Arg("final", "bool")]


class DeltaRuleOp(LinearScanOp):
    """`chunk(...)` (training and prefill), `recurrent(...)` (decoding) and `call_spec` for the delta rule:
    S_t = exp(g_t) (I - b_t k_t k_t^T) S_(t-1) + b_t k_t v_t^T (no gate: g = 0), o_t = scale S_t^T q_t, one state
    S [N, H, K, V] fp32. Construction, launch and state layout: LinearScanOp's."""

    ARGS = _ARGS

    @staticmethod
    def _fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: Any, beta: torch.Tensor,  # type: ignore[override]
              s_init: Any, cu_seqlens: Any, scale: float, chunk: int, final: bool) -> tuple:
        n_seq = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        shape = (n_seq, q.shape[2], q.shape[3], v.shape[3]) if final else (0,)
        return v.new_empty((*q.shape[:3], v.shape[3])), q.new_empty(shape, dtype=torch.float32)

    def _backward(self, grads: tuple, saved: tuple, constants: tuple, needs: tuple, stash: Any) -> list:
        do, ds_fin = grads
        q, k, v, g, beta, s_init, cu_seqlens = saved
        scale, chunk, _ = constants
        # (the kernels read the final state's gradient as a contiguous [N, H, K, V]: a slice of a wider one, or a
        # transposed one, arrives strided)
        ds_fin = ds_fin.contiguous() if ds_fin is not None and ds_fin.numel() > 0 else None
        return list(self._launch_backward(do, ds_fin, q, k, v, g, beta, s_init, cu_seqlens, scale, chunk))

    @staticmethod
    def _backward_fake(grads: tuple, saved: tuple, constants: tuple, needs: tuple) -> list:
        q = saved[0]
        return [torch.empty_like(t) if t is not None else q.new_empty(0) for t in saved[:6]]

    def chunk(self, q: Any, k: Any, v: Any, g: Any = None, beta: Any = None,  # type: ignore[override]
              scale: Any = None, initial_state: Any = None, output_final_state: bool = False, cu_seqlens: Any = None,
              *, chunk_size: int | None = None) -> tuple:
        """The chunked op in fla's chunk_gated_delta_rule positional order (q, k, v, g, beta, scale, initial_state,
        output_final_state, cu_seqlens; without a gate in the spec, chunk_delta_rule's: q, k, v, beta, scale, ...). q, k
        [B, T, H, K] (k l2-normalised, as fla's layers do, for a contracting update), v [B, T, H, V], g [B, T, H]
        natural-log gates (<= 0; -inf resets), beta [B, T, H] (0 < beta < 2), or all head-first [B, H, T, ...] where the
        spec declares them so (no cu_seqlens then); k and v with H / G heads where the spec splits `head = kvhead *
        group` (GQA: each query head keeps a state of its own, its gate and beta its own). scale: a number or a
        one-element tensor (its gradient is computed when it requires one); None takes the spec's default.
        initial_state: S [N, H, K, V] fp32 or None. Returns (o [B, T, H, V], final state [N, H, K, V] fp32 or None).
        Non-finite inputs: the outputs are non-finite exactly where the recurrence's are, the gradients at least there;
        double backward raises."""
        (q, k, v, g, beta, s_init), scale, chunk_size, scale_tensor, shape = self._chunk_inputs(
            q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size)
        o, s_fin = self.op(q, k, v, g, beta, s_init, cu_seqlens, scale, chunk_size, bool(output_final_state))
        if shape is not None:
            o, (s_fin,) = as_head_first(o, (s_fin,), shape)
        if scale_tensor is not None:
            o = o * scale_tensor.to(o.dtype)
        return o, (s_fin if output_final_state else None)

    def chunk_with_state_map(self, q: Any, k: Any, v: Any, g: Any = None, beta: Any = None, scale: Any = None, *,
                             chunk_size: int | None = None) -> tuple:
        """A shard of a sequence run from a zero state, and the shard's state map, in one run (for sequence
        parallelism). From a state S_in, the shard gives S_t = A_t S_in + F_t, A_t = prod_(s <= t) exp(g_s)
        (I - b_s k_s k_s^T), so o_t = scale F_t^T q_t + S_in^T (scale A_t^T q_t). Values widened by K zero columns
        from the state [0 | I] carry F_t in their first V columns and A_t in the other K. Arguments as `chunk`'s
        (fla's layout, no cu_seqlens). Returns (o [B, T, H, V] from zero, scale A_t^T q_t [B, T, H, K] (with a
        tensor scale's factor, in o's dtype), F [B, H, K, V], A [B, H, K, K] fp32), differentiable."""
        (q, k, v, g, beta, _), scale, chunk_size, scale_tensor, _ = self._chunk_inputs(
            q, k, v, g, beta, scale, None, None, chunk_size)
        batch, heads, dk, dv = q.shape[0], q.shape[2], k.shape[-1], v.shape[-1]
        identity = torch.eye(dk, device=q.device).expand(batch, heads, dk, dk)
        wide, ends = self.op(q, k, torch.cat([v, v.new_zeros(*v.shape[:-1], dk)], -1), g, beta,
                             torch.cat([identity.new_zeros(batch, heads, dk, dv), identity], -1), None, scale,
                             chunk_size, True)
        if scale_tensor is not None:
            wide = wide * scale_tensor.to(wide.dtype)
        return (*wide.split([dv, dk], -1), *ends.split([dv, dk], -1))

    def _chunk_inputs(self, q: Any, k: Any, v: Any, g: Any, beta: Any, scale: Any, initial_state: Any,
                      cu_seqlens: Any, chunk_size: int | None) -> tuple:
        """`chunk`'s inputs checked and laid out for the kernels: ((q, k, v, g, beta, s_init), the kernel's scale,
        the chunk size, the tensor scale or None, the head-first shape or None)."""
        chunk_size = self.chunk_size if chunk_size is None else chunk_size
        if chunk_size not in CHUNK_SIZES:  # the UT transform's blocks of 16 rows: 1, 2 or 4 per chunk
            raise CallError(None, detail=f"{self.spec_name}: chunk_size must be 16, 32 or 64, got {chunk_size}")
        if beta is None:
            raise CallError(None, detail=f"{self.spec_name}: {self.roles.beta} (beta) is required")
        self._check_presence(q, k, v, g, beta, None, scale)
        sizes = self._check(q, k, v, g, beta, None, initial_state, cu_seqlens, chunk_size)
        scale, scale_tensor = self._kernel_scale(scale, sizes)
        s_init = initial_state.float().contiguous() if initial_state is not None else None
        shape = None
        if self.roles.head_first:  # [B, H, T, D] is [B * H, T, 1, D]: B * H sequences of one head
            (q, k, v, g, beta), (s_init,), shape = as_one_head_sequences((q, k, v, g, beta), (s_init,))
        k, v = _per_query_head(q, k, v)
        inputs = (q.contiguous(), k.contiguous(), v.contiguous(), None if g is None else g.contiguous(),
                  beta.contiguous(), s_init)
        return inputs, float(scale), int(chunk_size), scale_tensor, shape

    def recurrent(self, q: Any, k: Any, v: Any, g: Any = None, beta: Any = None,  # type: ignore[override]
                  scale: Any = None, initial_state: Any = None, output_final_state: bool = True) -> tuple:
        """Decoding: the recurrence token by token from a state (fla's fused_recurrent convention), typically one
        token per call after a prefill by `chunk(..., output_final_state=True)`. Arguments as `chunk`'s (no
        cu_seqlens: one state per batch entry, S [B, H, K, V] fp32 or None). Returns (o [B, T, H, V], the state
        after the last token or None). Inference only: inputs that require a gradient are refused."""
        if beta is None:
            raise CallError(None, detail=f"{self.spec_name}: {self.roles.beta} (beta) is required")
        self._check_presence(q, k, v, g, beta, None, scale)
        sizes = self._check(q, k, v, g, beta, None, initial_state, None, self.chunk_size)
        if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                           for t in (q, k, v, g, beta, scale, initial_state)):
            raise CallError(None, detail=f"{self.spec_name}: recurrent() is for decoding and has no backward; an "
                            "input requires a gradient (use chunk() to train, or call under torch.no_grad())")
        scale = float(self._scale(scale, sizes)) * self.output_factor
        shape = None
        if self.roles.head_first:
            (q, k, v, g, beta), (initial_state,), shape = as_one_head_sequences((q, k, v, g, beta),
                                                                                (initial_state,))
        k, v = _per_query_head(q, k, v)
        o, s_fin = self._launch_step(q, k, v, g, beta, initial_state, scale)
        if shape is not None:
            o, (s_fin,) = as_head_first(o, (s_fin,), shape)
        return o, (s_fin if output_final_state else None)
