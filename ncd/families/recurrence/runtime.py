"""The recurrence family's op (Gated KalmaNet) on the shared runtime, with fla's conventions.

The generated module hands over its launchers `forward(q, k, v, g, beta, alpha, h_init, s_init, cu_seqlens, scale,
ridge, num_iter, chunk, final, save) -> (o, h_fin, s_fin, x, norm)` and `backward(do, dh_fin, ds_fin, q, ..., x, norm,
h_fin, s_fin, scale, ridge, num_iter, chunk) -> 8 gradients`, its `chunk_table`, the spec's input names and axes,
and the scale's default. `GKAOp.chunk` checks a call, keeps non-finite inputs from spreading (NaN in, NaN out only
where the math puts it) and runs the kernels through the shared runtime."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import torch

from ncd import runtime as rt
from ncd.errors import CallError
from ncd.op_runtime import Arg, KernelOp

# A log gate below this is the same gate in fp32 (exp(g) underflows to 0 below about -104): the kernels take
# g >= G_FLOOR, so that g = -inf (a full reset) forms no -inf - -inf in the decay exponents.
G_FLOOR = -200.0
CHUNK_SIZES = (16, 32, 64, 128)

_ARGS = [Arg("q", grad=True), Arg("k", grad=True), Arg("v", grad=True), Arg("g", grad=True),
         Arg("gk", "Tensor?", grad=True), Arg("beta", "Tensor?", grad=True), Arg("alpha", "Tensor?", grad=True),
         Arg("h_init", "Tensor?", grad=True), Arg("s_init", "Tensor?", grad=True), Arg("cu_seqlens", "Tensor?"),
         Arg("scale", "float"), Arg("ridge", "float"), Arg("ridge_offset", "float"), Arg("num_iter", "int"),
         Arg("chunk", "int"), Arg("final", "bool"), Arg("save", "bool")]
_RESULTS = ["o", "h_fin", "s_fin", "x", "norm"]  # x (the solve's solution) and norm: saved for the backward only


@dataclass(frozen=True)
class Roles:
    """The spec's names of the op's inputs (None: the spec has no such input) and each one's axes."""

    q: str
    k: str
    v: str
    g: str | None  # None: no gate (the delta rule; Gated KalmaNet's U ungated)
    beta: str | None
    alpha: str | None
    scale: str | None
    axes: Mapping[str, tuple[str, ...]]  # role (q k v g beta alpha o) -> spec axes
    head_first: bool = False  # [batch head time dim] (the op runs it as batch x head sequences of one head)
    gate_per_head: bool = False  # g[head] (gated linear attention only): one decay per head at every token
    # Gated KalmaNet's H: "g" (U's gate), "gk" (an input of its own, named gk) or None (ungated)
    h_gate: str | None = "g"
    gk: str | None = None


def _opt(t: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is not None and t.numel() > 0 else None


def as_one_head_sequences(tensors: Sequence[Any], states: Sequence[Any]) -> tuple[list, list, tuple[int, int]]:
    """Head-first tensors [B, H, T, ...] as fla-layout ones [B * H, T, 1, ...]: B * H sequences of one head (views
    where contiguous); states [B, H, ...] as [B * H, 1, ...]. None stays None."""
    B, H, T = tensors[0].shape[:3]
    per_token = [t if t is None else t.reshape(B * H, T, 1, *t.shape[3:]) for t in tensors]
    per_sequence = [t if t is None else t.reshape(B * H, 1, *t.shape[2:]) for t in states]
    return per_token, per_sequence, (B, H)


def as_head_first(o: torch.Tensor, states: Sequence[Any], shape: tuple[int, int]) -> tuple[torch.Tensor, list]:
    """as_one_head_sequences undone for an output [B * H, T, 1, V] and states [B * H, 1, ...] (empty: kept)."""
    B, H = shape
    o = o.reshape(B, H, o.shape[1], o.shape[3])
    return o, [t if t is None or t.numel() == 0 else t.reshape(B, H, *t.shape[2:]) for t in states]


class ScanOp(ABC):
    """What the recurrence ops share: call checks (names, axes, dtypes, devices, cu_seqlens, initial states), the
    scale's resolution and the function named after the spec. Subclasses set the attributes below and say their
    initial states' shapes (`_state_shapes`)."""

    spec_name: str
    roles: Roles
    axes: Mapping[str, tuple[int | None, tuple]]
    output_factor: float
    _checked: rt.CheckMemo  # call signature -> axis sizes, checks passed
    scale_default: Callable[[dict[str, int]], float | None]
    _chunk_table: Callable[..., Any]

    @staticmethod
    @abstractmethod
    def _state_shapes(initial_state: Any, n_seq: int, heads: int, K: int, V: int) -> list:
        """(name, tensor, shape, axes) of each initial state."""

    # --- calls --------------------------------------------------------------------------------------------------

    def _check(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: Any, alpha: Any,
               initial_state: Any, cu_seqlens: Any, chunk_size: int, gk: Any = None) -> dict[str, int]:
        """The size of every axis (read-only), or CallError. Remembered per call signature (rt.CheckMemo: decoding
        calls are host-bound) where the checks read nothing but shapes, dtypes and devices: no cu_seqlens (its
        values are checked), and initial states absent or two tensors."""
        signature = None
        if (cu_seqlens is None and chunk_size in CHUNK_SIZES and not torch.compiler.is_compiling()
                and (initial_state is None or (isinstance(initial_state, (tuple, list)) and len(initial_state) == 2
                                               and all(isinstance(t, torch.Tensor) for t in initial_state)))):
            signature = rt.CheckMemo.signature(q, k, v, g, gk, beta, alpha, *(initial_state or (None, None)))
            found = self._checked.get(signature)
            if found is not None:
                return found  # type: ignore[return-value]
        sizes = self._check_call(q, k, v, g, beta, alpha, initial_state, cu_seqlens, chunk_size, gk)
        self._checked.put(signature, sizes)
        return sizes

    def _check_call(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: Any, alpha: Any,
                    initial_state: Any, cu_seqlens: Any, chunk_size: int, gk: Any = None) -> dict[str, int]:
        r = self.roles
        tensors = [(r.q, q, r.axes["q"]), (r.k, k, r.axes["k"]), (r.v, v, r.axes["v"])]
        if g is not None:
            tensors.append((r.g or "g", g, r.axes["g"]))
        if gk is not None:
            tensors.append((r.gk or "gk", gk, r.axes["gk"]))
        if beta is not None:
            tensors.append((r.beta or "beta", beta, r.axes["beta"]))
        if alpha is not None:
            tensors.append((r.alpha or "alpha", alpha, r.axes["alpha"]))
        sizes = rt.bind_axes(self.axes, tensors)
        rt.check_floats([(name, t) for name, t, _ in tensors[:3]])
        rt.check_floats([(name, t) for name, t, _ in tensors[3:]], same_dtype=False)
        rt.check_device([(name, t) for name, t, _ in tensors])
        if chunk_size not in CHUNK_SIZES:
            raise CallError(None, detail=f"chunk_size must be 16, 32, 64 or 128, got {chunk_size}")
        if q.numel() >= 2**31 or v.numel() >= 2**31:
            raise CallError(None, detail=f"{self.spec_name}: tensors too large for the kernels' 32-bit offsets")
        n_seq = q.shape[0]
        if cu_seqlens is not None and r.head_first:
            raise CallError(None, detail=f"{self.spec_name}: cu_seqlens packs sequences along time in fla's "
                            "[batch time head dim] layout; this spec declares its inputs head-first")
        if cu_seqlens is not None:
            if q.shape[0] != 1:
                raise CallError(None, detail=f"with cu_seqlens, {r.q} must have batch 1 (packed), got {q.shape[0]}")
            if cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
                raise CallError(None, detail="cu_seqlens must be a 1-D int32/int64 tensor [N + 1]")
            bounds = self._chunk_table(1, q.shape[1], cu_seqlens, chunk_size, q.device)[5]  # the one host read
            if bounds[0] != 0 or bounds[-1] != q.shape[1] or any(b < a for a, b in pairwise(bounds)):
                raise CallError(None, detail=f"cu_seqlens must rise from 0 to {q.shape[1]} (the packed length), "
                                f"got {bounds}")
            n_seq = len(bounds) - 1
        if initial_state is not None:
            heads, K, V = q.shape[1 if r.head_first else 2], q.shape[3], v.shape[3]
            for name, t, shape, layout in self._state_shapes(initial_state, n_seq, heads, K, V):
                if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
                    got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                    raise CallError(None, detail=f"{name} must have shape {shape} [{layout}], got {got}")
                rt.check_device([(r.q, q), (name, t)])
        return sizes

    def _scale(self, scale: Any, sizes: dict[str, int]) -> Any:
        """The call's scale (the spec's default where None): a number or a one-element tensor, else CallError."""
        if scale is None:
            scale = self.scale_default(sizes)
        if scale is None:
            raise CallError(None, detail=f"{self.spec_name}: scale is required (the spec gives it no default)")
        if isinstance(scale, torch.Tensor) and scale.numel() != 1:
            raise CallError(None, detail=f"{self.spec_name}: scale must be a number or a one-element tensor, got "
                            f"shape {tuple(scale.shape)}")
        return scale

    def _kernel_scale(self, scale: Any, sizes: dict[str, int]) -> tuple[float, torch.Tensor | None]:
        """The kernels' scale (the output factor included) and, for a scale that needs its gradient, the tensor
        that multiplies their output instead (the kernels then run at scale 1 and autograd takes the product)."""
        scale = self._scale(scale, sizes)
        if isinstance(scale, torch.Tensor) and scale.requires_grad and torch.is_grad_enabled():
            return self.output_factor, scale.reshape(())
        return float(scale) * self.output_factor, None

    def _check_presence(self, q: Any, k: Any, v: Any, g: Any, beta: Any, alpha: Any, scale: Any,
                        gk: Any = None) -> None:
        r = self.roles
        for name, t in ((r.q, q), (r.k, k), (r.v, v), (r.g, g), (r.gk, gk)):
            if name is not None and not isinstance(t, torch.Tensor):
                raise CallError(None, detail=f"{self.spec_name}: {name} must be a tensor, got {type(t).__name__}")
        for name, t, in_spec in (("g", g, r.g is not None), ("gk", gk, r.gk is not None),
                                 ("beta", beta, r.beta is not None), ("alpha", alpha, r.alpha is not None)):
            if t is not None and not in_spec:
                raise CallError(None, detail=f"{self.spec_name}: the spec has no {name} input, so {name} must be "
                                "None; it would be ignored")
        if scale is not None and r.scale is None:
            raise CallError(None, detail=f"{self.spec_name}: the spec has no scale input, so scale must be None; it "
                            "would be ignored")

    def call_spec(self, required: Sequence[tuple[str, Any]], **inputs: Any) -> torch.Tensor:
        """The function named after the spec: its inputs by role; those without a default must be given."""
        for name, value in required:
            if value is None:
                raise CallError(None, detail=f"{self.spec_name}: {name} is required (the spec gives it no default)")
        return self.chunk(**inputs)[0]

    @abstractmethod
    def chunk(self, *args: Any, **kwargs: Any) -> tuple:
        """The chunked op: (o, final state or None)."""


class GKAOp(ScanOp):
    """The chunked op: `chunk(...)` with fla's conventions, `recurrent(...)` for decoding from a state, and
    `call_spec` for the function named after the spec."""

    def __init__(self, spec_name: str, op_id: str, *, roles: Roles, axes: Mapping[str, tuple[int | None, tuple]],
                 forward: Callable[..., Any], backward: Callable[..., Any], chunk_table: Callable[..., Any],
                 step: Callable[..., Any], output_factor: float,
                 scale_default: Callable[[dict[str, int]], float | None], ridge: float, num_iter: int,
                 chunk_size: int, ridge_offset: float = 0.0) -> None:
        self.spec_name, self.roles, self.axes = spec_name, roles, axes
        self.ridge, self.num_iter, self.chunk_size = ridge, num_iter, chunk_size  # the spec's and the plan's
        self.ridge_offset = ridge_offset
        self._checked = rt.CheckMemo()
        self._launch_forward, self._launch_backward, self._chunk_table = forward, backward, chunk_table
        self._launch_step = step
        self.output_factor, self.scale_default = output_factor, scale_default
        self.op = KernelOp(f"ncd::{op_id}", spec_name, _ARGS, _RESULTS, differentiable=3, save_results=(3, 4, 1, 2),
                           forward=self._forward, fake=self._fake, backward=self._backward,
                           backward_fake=self._backward_fake)

    # --- launchers in the runtime's conventions ----------------------------------------------------------------

    def _forward(self, *args: Any) -> tuple:
        o, h_fin, s_fin, x, norm = self._launch_forward(*args)
        final = args[15]
        if not final:  # distinct empty tensors (the runtime's): custom-op outputs may not alias each other
            h_fin = s_fin = None
        return o, h_fin, s_fin, x, norm

    @staticmethod
    def _fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, gk: Any, beta: Any, alpha: Any,
              h_init: Any, s_init: Any, cu_seqlens: Any, scale: float, ridge: float, ridge_offset: float,
              num_iter: int, chunk: int, final: bool, save: bool) -> tuple:
        n_seq = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        heads, K, V = q.shape[2], q.shape[3], v.shape[3]
        f32 = torch.float32
        return (v.new_empty(v.shape), q.new_empty((n_seq, heads, K, K) if final else (0,), dtype=f32),
                q.new_empty((n_seq, heads, K, V) if final else (0,), dtype=f32),
                q.new_empty(q.shape if save else (0,), dtype=f32), q.new_empty(g.shape, dtype=f32))

    def _backward(self, grads: tuple, saved: tuple, constants: tuple, needs: tuple, stash: Any) -> list:
        do, dh_fin, ds_fin = grads
        *inputs, x, norm, h_fin, s_fin = saved
        scale, ridge, ridge_offset, num_iter, chunk = constants[:5]
        return list(self._launch_backward(do, _opt(dh_fin), _opt(ds_fin), *inputs, x, norm, _opt(h_fin),
                                          _opt(s_fin), scale, ridge, ridge_offset, num_iter, chunk))

    @staticmethod
    def _backward_fake(grads: tuple, saved: tuple, constants: tuple, needs: tuple) -> list:
        q = saved[0]
        return [torch.empty_like(t) if t is not None else q.new_empty(0) for t in saved[:9]]

    @staticmethod
    def _state_shapes(initial_state: Any, n_seq: int, heads: int, K: int, V: int) -> list:
        """(name, tensor, shape, axes) of each initial state."""
        if not (isinstance(initial_state, (tuple, list)) and len(initial_state) == 2):
            raise CallError(None, detail="initial_state must be a pair (H [N, H, K, K], S [N, H, K, V])")
        h0, s0 = initial_state
        return [("initial_state[0]", h0, (n_seq, heads, K, K), "sequence head key key"),
                ("initial_state[1]", s0, (n_seq, heads, K, V), "sequence head key value")]

    def _gates(self, g: Any, gk: Any, like: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The kernels' gates: S's (zeros where the spec leaves U ungated) and H's (None: S's gates H too)."""
        r = self.roles

        def zeros() -> torch.Tensor:
            return torch.zeros(like.shape[:3], dtype=torch.float32, device=like.device)

        g_s = g if r.g is not None else zeros()
        if r.h_gate == "g" or (r.h_gate is None and r.g is None):  # one gate for both (zeros: neither gated)
            return g_s, None
        return g_s, gk if r.h_gate == "gk" else zeros()

    def chunk(self, q: Any, k: Any, v: Any, g: Any = None, beta: Any = None, scale: Any = None,
              initial_state: Any = None, output_final_state: bool = False, cu_seqlens: Any = None, *,
              alpha: Any = None, gk: Any = None,
              ridge: float | None = None, ridge_offset: float | None = None, num_iter: int | None = None,
              chunk_size: int | None = None) -> tuple:
        """The chunked op with fla's conventions, in the positional order of fla's chunk_gated_delta_rule (q, k, v, g,
        beta, scale, initial_state, output_final_state, cu_seqlens); alpha, gk and the rest by keyword only. q, k [B, T,
        H, K], v [B, T, H, V] (k and v [B, T, H / G, ...] where the spec splits `head = kvhead * group`: GQA), g [B, T,
        H] (or all head-first, [B, H, T, ...], where the spec declares them so; no cu_seqlens then) natural-log gates
        (<= 0; -inf is a full reset) of both states, or of U alone where the spec gives the covariance H a gate of its
        own, gk [B, T, H] (None where it has none; g None where U is ungated), beta and alpha [B, T, H] or None (no
        key/value scaling; alpha = 1; either must be None where the spec has no such input). scale: a number or a
        one-element tensor (its gradient is computed when it requires one). initial_state: (H [N, H, K, K], S [N, H, K,
        V]) fp32 or None. Returns (o [B, T, H, V], final_state or None). A non-finite input makes NaN exactly the
        outputs it reaches (guard_non_finite); double backward raises. ridge, ridge_offset (lambda = ridge ||H|| +
        ridge_offset), num_iter, chunk_size: None takes the op's own."""
        ridge = self.ridge if ridge is None else ridge
        ridge_offset = self.ridge_offset if ridge_offset is None else ridge_offset
        num_iter = self.num_iter if num_iter is None else num_iter
        chunk_size = self.chunk_size if chunk_size is None else chunk_size
        self._check_presence(q, k, v, g, beta, alpha, scale, gk)
        sizes = self._check(q, k, v, g, beta, alpha, initial_state, cu_seqlens, chunk_size, gk)
        _check_ridge(self.spec_name, ridge, ridge_offset)
        scale, scale_tensor = self._kernel_scale(scale, sizes)
        shape = None
        if self.roles.head_first:  # [B, H, T, D] is [B * H, T, 1, D]: B * H sequences of one head
            (q, k, v, g, gk, beta, alpha), states, shape = as_one_head_sequences((q, k, v, g, gk, beta, alpha),
                                                                                 initial_state or (None, None))
            initial_state = None if initial_state is None else tuple(states)
        packed = cu_seqlens is not None
        bounds = self._chunk_table(1, q.shape[1], cu_seqlens, chunk_size, q.device)[5] if packed else None
        k, v = _per_query_head(q, k, v)
        given = (q, k, v, g, gk, beta, alpha)
        g, gk = self._gates(g, gk, q)
        q, k, v, g, gk, beta, alpha, poisoned, seq_poisoned = guard_non_finite(q, k, v, g, gk, beta, alpha, bounds,
                                                                               packed)
        h_init, s_init = initial_state if initial_state is not None else (None, None)
        contig = [t.contiguous() if t is not None else None for t in (q, k, v, g, gk, beta, alpha)]
        inits = [t.float().contiguous() if t is not None else None for t in (h_init, s_init)]
        # x is saved only for a backward: an inference call skips its store (T x H x K floats)
        save = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (*contig, *inits))
        o, h_fin, s_fin, _, _ = self.op(*contig, *inits, cu_seqlens, float(scale), float(ridge), float(ridge_offset),
                                        int(num_iter), int(chunk_size), bool(output_final_state), save)
        if scale_tensor is not None:
            o = o * scale_tensor.to(o.dtype)
        if save and not torch.compiler.is_compiling():
            o = NaNOutputs.apply(o, poisoned, bounds, packed, self.spec_name, *given, *(initial_state or (None, None)),
                                 scale_tensor)
        else:
            o = torch.where(poisoned[..., None], float("nan"), o)
        final = None
        if output_final_state:
            nan_states = seq_poisoned[..., None, None]
            final = (torch.where(nan_states, float("nan"), h_fin), torch.where(nan_states, float("nan"), s_fin))
        if shape is None:
            return o, final
        o, final_states = as_head_first(o, final or (None, None), shape)
        return o, (tuple(final_states) if final is not None else None)

    def recurrent(self, q: Any, k: Any, v: Any, g: Any = None, beta: Any = None, scale: Any = None,
                  initial_state: Any = None, output_final_state: bool = True, *, alpha: Any = None, gk: Any = None,
                  ridge: float | None = None, ridge_offset: float | None = None, num_iter: int | None = None
                  ) -> tuple:
        """Decoding: the recurrence token by token from a state (fla's fused_recurrent convention), for a few
        tokens per call (typically one) after a prefill by `chunk(..., output_final_state=True)`. Arguments as
        `chunk`'s (no cu_seqlens: one state per batch entry); initial_state (H [B, H, K, K], S [B, H, K, V]) fp32 or
        None (zero states). Returns (o [B, T, H, V], (H, S) after the last token, or None). Inference only: inputs
        that require a gradient are refused (use `chunk` to train)."""
        ridge = self.ridge if ridge is None else ridge
        ridge_offset = self.ridge_offset if ridge_offset is None else ridge_offset
        num_iter = self.num_iter if num_iter is None else num_iter
        self._check_presence(q, k, v, g, beta, alpha, scale, gk)
        sizes = self._check(q, k, v, g, beta, alpha, initial_state, None, self.chunk_size, gk)
        _check_ridge(self.spec_name, ridge, ridge_offset)
        if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                           for t in (q, k, v, g, gk, beta, alpha, scale, *(initial_state or ()))):
            raise CallError(None, detail=f"{self.spec_name}: recurrent() is for decoding and has no backward; an "
                            "input requires a gradient (use chunk() to train, or call under torch.no_grad())")
        scale = float(self._scale(scale, sizes)) * self.output_factor
        shape = None
        if self.roles.head_first:
            (q, k, v, g, gk, beta, alpha), states, shape = as_one_head_sequences((q, k, v, g, gk, beta, alpha),
                                                                                 initial_state or (None, None))
            initial_state = None if initial_state is None else tuple(states)
        h_init, s_init = initial_state if initial_state is not None else (None, None)
        g, gk = self._gates(g, gk, q)
        k, v = _per_query_head(q, k, v)
        o, h_fin, s_fin = self._launch_step(q, k, v, g, gk, beta, alpha, h_init, s_init, scale, ridge, ridge_offset,
                                            num_iter)
        if shape is not None:
            o, (h_fin, s_fin) = as_head_first(o, (h_fin, s_fin), shape)
        return o, ((h_fin, s_fin) if output_final_state else None)


def _per_query_head(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GQA keys and values [B, T, H / G, ...] repeated for each of their G query heads (the call check has bound
    `head = kvhead * group`): each query head has states of its own, and autograd sums dk, dv over a group."""
    group = q.shape[2] // k.shape[2]
    if group == 1:
        return k, v
    return k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)


def _check_ridge(name: str, ridge: float, ridge_offset: float) -> None:
    if not (ridge >= 0 and ridge_offset >= 0 and ridge + ridge_offset > 0):
        raise CallError(None, detail=f"{name}: ridge and ridge_offset must be >= 0 and not both 0 (lambda = ridge "
                        f"||H|| + ridge_offset is the solve's lower spectrum bound), got {ridge}, {ridge_offset}")


# --- non-finite inputs ------------------------------------------------------------------------------------------


def _count_along_time(hit: torch.Tensor, reverse: bool = False) -> torch.Tensor:
    """[B, T, H] running count of True along time (from the end with `reverse`), scanned along the contiguous axis
    of a transposed copy: torch's scan over the outer axis of [B, T, H] took 1.45 ms of a 4.4 ms GKA forward (H100,
    B 4, T 8192, H 8; bench/log/2026-11-27-issue33-s3.md)."""
    rows = hit.to(torch.int32).transpose(1, 2).contiguous()
    count = rows.flip(2).cumsum(2).flip(2) if reverse else rows.cumsum(2)
    return count.transpose(1, 2)


def poisoned_from(bad: torch.Tensor, bounds: Any, packed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T, H] True from the first True of each sequence (and head) on; with `packed`, sequences are the
    [bounds[n], bounds[n + 1]) ranges of time. Also [N, H]: whether sequence n has any True."""
    count = _count_along_time(bad)
    if not packed:
        return count > 0, bad.any(1)
    starts = torch.tensor(bounds[:-1], device=bad.device)
    lengths = torch.tensor([hi - lo for lo, hi in pairwise(bounds)], device=bad.device)
    before = torch.cat([count.new_zeros((1, 1, count.shape[2])), count], 1)  # before[:, t] = count up to t - 1
    base = torch.repeat_interleave(before[:, starts], lengths, dim=1)
    ends = torch.tensor(bounds[1:], device=bad.device)
    return count - base > 0, (before[0, ends] - before[0, starts]) > 0


def reached_from_later(hit: torch.Tensor, bounds: Any, packed: bool) -> torch.Tensor:
    """[B, T, H] True at and before the last True of each sequence (and head): the tokens whose keys, values,
    gates and betas a NaN output at a True token depends on."""
    suffix = _count_along_time(hit, reverse=True)  # suffix[:, t] = count over [t, T)
    if not packed:
        return suffix > 0
    after = torch.cat([suffix, suffix.new_zeros((1, 1, suffix.shape[2]))], 1)  # after[:, T] = 0
    lengths = torch.tensor([hi - lo for lo, hi in pairwise(bounds)], device=hit.device)
    ends = torch.tensor(bounds[1:], device=hit.device)
    return suffix - torch.repeat_interleave(after[:, ends], lengths, dim=1) > 0


class NaNOutputs(torch.autograd.Function):
    """o with NaN at the poisoned tokens; backward: the clean tokens' gradient passes, and a NaN output that gets
    a gradient (do != 0) makes NaN the gradients of exactly what it depends on: keys, values, gates and betas
    of its sequence and head up to it, its own query and alpha, its sequence's initial states, a tensor scale.
    Those NaNs are added to the gradients the kernels compute from the clean tokens."""

    @staticmethod
    def forward(ctx: Any, o: torch.Tensor, poisoned: torch.Tensor, bounds: Any, packed: bool,  # type: ignore[override]
                name: str, *inputs: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(poisoned)
        ctx.name = name
        ctx.layout = (bounds, packed)
        ctx.shapes = [None if t is None else (t.shape, t.dtype) for t in inputs]
        return torch.where(poisoned[..., None], float("nan"), o)

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor) -> Any:  # type: ignore[override]
        if torch.is_grad_enabled():  # create_graph: the kernels' gradients are not differentiable
            raise RuntimeError(f"{ctx.name}: double backward (create_graph=True) is not supported")
        (poisoned,) = ctx.saved_tensors
        hit = poisoned & (do != 0).any(-1)  # NaN != 0 too
        state = reached_from_later(hit, *ctx.layout)
        sequence_hit = poisoned_from(hit, *ctx.layout)[1]
        # q, k, v, g, gk, beta, alpha, h_init, s_init, scale
        reach = [hit, state, state, state, state, state, hit, sequence_hit, sequence_hit, hit.any()]
        grads: list[torch.Tensor | None] = []
        for i, (shape_dtype, mask) in enumerate(zip(ctx.shapes, reach, strict=True)):
            if shape_dtype is None or not ctx.needs_input_grad[5 + i]:
                grads.append(None)
                continue
            shape, dtype = shape_dtype
            mask = mask.reshape(tuple(mask.shape) + (1,) * (len(shape) - mask.dim()))
            grads.append(torch.where(mask, float("nan"), 0.0).to(dtype).expand(shape))
        return (torch.where(poisoned[..., None], 0.0, do), None, None, None, None, *grads)


def _max_norm(t: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(t, float("inf"), -1)


def guard_non_finite(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, gk: Any, beta: Any,
                     alpha: Any, bounds: Any, packed: bool) -> tuple:
    """NaN in, NaN out where the math puts it and nowhere else. A non-finite key, value, beta or a NaN / +inf gate
    at token t breaks the states from t on: the outputs of its sequence and head from t on (and its final
    states) are NaN; a non-finite query or alpha breaks its own output row only. The kernels see those tokens
    as zeros (a dense chunk product would spread 0 * NaN to every row of the chunk); NaNOutputs sends NaN
    gradients back where the math does. g = -inf (a full reset, exp(g) = 0) is legal: the kernels take it as
    G_FLOOR, whose gradient is 0 as exp(g)'s is."""
    # a row holds a NaN or an infinity exactly when its largest magnitude is not finite (the max-norm propagates
    # NaN): one read of each tensor, no [B, T, H, K] temporaries
    state_bad = ~torch.isfinite(_max_norm(k)) | ~torch.isfinite(_max_norm(v))
    for gate in (g, gk):
        if gate is not None:
            state_bad |= torch.isnan(gate) | (gate == float("inf"))
    if beta is not None:
        state_bad |= ~torch.isfinite(beta)
    row_bad = ~torch.isfinite(_max_norm(q))
    if alpha is not None:
        row_bad |= ~torch.isfinite(alpha)
    after, seq_bad = poisoned_from(state_bad, bounds, packed)

    def zero(t: Any, bad: torch.Tensor) -> Any:
        return t if t is None else torch.where(bad[..., None] if t.dim() == 4 else bad, 0.0, t).to(t.dtype)

    def floored(gate: Any) -> Any:
        gate = zero(gate, state_bad)
        return gate if gate is None else torch.where(gate < G_FLOOR, G_FLOOR, gate).to(gate.dtype)

    return (zero(q, row_bad | after), zero(k, state_bad), zero(v, state_bad), floored(g), floored(gk),
            zero(beta, state_bad), zero(alpha, row_bad | after), after | row_bad, seq_bad)
