"""The attention family's op on the shared runtime: o = sum_j w_j a1(s_ij) v_j / b(sum_j w_j a2(s_ij)).

The kernels take q, k, v as [batch, head, n, dim] and the per-key weight (multiplicities) as [batch, key]; a
weight is a constant input of the spec (its gradient kernel runs in eager backwards only). The generated module
hands over its namespace: `AttentionOp` reads the launchers there at each call (`forward`, `backward_from_saved`,
`weight_gradient`; with the factorized form `forward_factorized`, `factorized_backward_from_saved` and
`_use_factorized`) and the numbers the fakes need (`ONLINE_MAX`, `head_tile`, `CHUNK`, `FACT_CAUSAL`,
`FACT_NEED_VEC`), so that a test or `ncd check` replacing a launcher on the module reaches the op. (Choices such as
the form are the config's: `Op.with_config`.)"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ncd import runtime as rt
from ncd.families.attention import kernel_decode, kernel_sink, mask_table, ring
from ncd.op_runtime import Arg, KernelOp

_ARGS = [Arg("q", grad=True), Arg("k", grad=True), Arg("v", grad=True), Arg("w", "Tensor?", grad=True),
         Arg("scale", "float")]


class AttentionOp:
    """`op(tensor inputs..., w, scale, sizes)` after `op.check(tensor inputs...)`; see the generated function."""

    def __init__(self, spec_name: str, op_id: str, namespace: Mapping[str, Any], *,
                 axes: Mapping[str, tuple[int | None, tuple[str, ...]]], inputs: Sequence[tuple[str, tuple]],
                 query: str, key: str, value: str, perms: Mapping[str, tuple[int, ...]], weight: str | None = None,
                 weight_layout: tuple[int, ...] | str | None = None, scale_grad: str | None = None,
                 factorized: bool = False,
                 modifiers: tuple[Sequence[tuple[str, int, bool, bool]], Sequence[str], Sequence[str],
                                  Sequence[tuple[str, str]]] = ((), (), (), ()),
                 sink: tuple[str | None, tuple[int, ...], float, bool] | None = None,
                 tables: tuple[bool, bool] | None = None, stat_rate: float = 0.0,
                 sequence: tuple[str, str] = ("", "")) -> None:
        self.spec_name, self.ns, self.axes = spec_name, namespace, axes
        self.sequence = sequence  # the query and key axes (what context parallelism shards)
        # the score and mask hooks' inputs (modifiers.py): tensors (name, dimensions, takes a gradient), scalar
        # inputs, and the axes whose sizes they read; after (q, k, v, w, scale) in that order
        tensors, scalars, sizes, layout = modifiers
        order = [*(name for name, _, _, _ in tensors), *scalars, *sizes]  # the op's modifier arguments, in order
        # the context's entries after (N_Q, N_K, GROUP): (index into those arguments, a tensor: pointer and strides)
        # ("offsets": a call-time index table over key - query, built by the generated host function of that name)
        self.mod_layout = tuple((name if kind == "offsets" else order.index(name), kind) for kind, name in layout)
        self._offset_tables: dict[tuple, torch.Tensor] = {}
        self.mod_tensors = tuple((name, int(dims), bool(grad)) for name, dims, grad, _ in tensors)
        self.mask_reads_tensors = any(mask for _, _, _, mask in tensors)
        self.mod_scalars, self.mod_sizes = tuple(scalars), tuple(sizes)
        args = [*_ARGS, *(Arg(f"m_{name}", grad=grad) for name, _, grad in self.mod_tensors),
                *(Arg(f"m_{name}", "float") for name in self.mod_scalars),
                *(Arg(f"size_{name}", "int") for name in self.mod_sizes)]
        # a sink (kernel_sink.py): its logit tensor (last argument; dims: positions among batch, head, query) or a
        # constant place, and whether the tensor takes a gradient
        self.tables = tables  # the mask's call-time range tables (mask_table.py): (reads the batch, the head)
        self.sink = sink
        self.sink_tensor = sink is not None and sink[0] is not None
        if self.sink_tensor:
            assert sink is not None
            args.append(Arg(f"s_{sink[0]}", grad=sink[3]))
        self.inputs = tuple((name, tuple(a)) for name, a in inputs)
        self.query, self.key, self.value = query, key, value
        self.perms = {role: tuple(p) for role, p in perms.items()}
        self.weight, self.weight_layout, self.scale_grad = weight, weight_layout, scale_grad
        self._checked = rt.CheckMemo()  # call signature -> axis sizes, checks passed
        self._ring_plans: dict = {}  # context parallelism's plans of a mask that reads no tensor (ring.py `_plan`)
        self.streamed = KernelOp(f"ncd::{op_id}", spec_name, args, ["o", "z", "m"], save_results=(0, 1, 2),
                                 forward=self._forward, fake=self._fake, backward=self._backward,
                                 backward_fake=self._backward_fake)
        # the op with the row statistic as a second, differentiable result (`return_lse`): lse = log of the row's
        # sum z = sum_j w_j a2(s_ij) (+ the sink's), as c2 m + log z from the running max m and the z kept relative
        # to it (stat_rate: a2's rate c2; 0 without the running max); -inf for a row with z = 0
        self.stat_rate = stat_rate
        self.with_lse = KernelOp(f"ncd::{op_id}_lse", spec_name, args, ["o", "lse", "z", "m"], save_results=(0, 2, 3),
                                 differentiable=2, forward=self._forward_lse, fake=self._fake_lse,
                                 backward=self._backward_lse, backward_fake=self._backward_fake)
        self.factorized = None
        if factorized:
            self.factorized = KernelOp(f"ncd::{op_id}_factorized", spec_name, _ARGS, ["o", "z", "h", "vec"],
                                       save_results=(0, 1, 2, 3), forward=self._forward_factorized,
                                       fake=self._fake_factorized, backward=self._backward_factorized,
                                       backward_fake=self._backward_fake)

    # --- launchers in the runtime's conventions ----------------------------------------------------------------

    def _context(self, q: torch.Tensor, k: torch.Tensor, tensors: Sequence[torch.Tensor], constants: Sequence[Any],
                 columns: bool = False, place: tuple[int, int, int, int] | None = None) -> tuple | None:
        """The hooks' context tuple C: (N_Q, N_K, GROUP, the shard's place (base_context), each tensor's pointer and
        strides, the scalars, the sizes), in modifiers.py's order, then the mask's range tables where it has them
        (mask_table.py: the rows table, and the columns table with `columns`, else the rows table again in its
        place: a context for the forward only, as the dK/dV kernels would read that [.., N_Q, 4] table at key
        indices); None without modifiers."""
        if not self.ns["KERNELS"].modified:
            return None
        context = self.base_context(q, k, tensors, constants, place)
        return context + tuple(self._tables(q, k, context, columns)) if self.tables is not None else context

    def base_context(self, q: torch.Tensor, k: torch.Tensor, tensors: Sequence[torch.Tensor],
                     constants: Sequence[Any], place: tuple[int, int, int, int] | None = None) -> tuple:
        """C without the range tables: what the MASK hook and the compile-time bounds read. place: (query offset,
        key offset, total queries, total keys) of a shard of the sequence (context parallelism); None: the call
        holds the whole sequence."""
        values = (*tensors, *constants)
        n_q, n_k = q.shape[2], k.shape[2]
        context: list[Any] = [n_q, n_k, q.shape[1] // k.shape[1], *(place or (0, 0, n_q, n_k))]
        for entry, kind in self.mod_layout:
            if kind == "offsets":  # over the offsets of the whole sequence
                context.append(self._offsets(str(entry), context[5], context[6], q.device))
                continue
            value = values[int(entry)]
            context += [value, *value.stride()] if kind == "tensor" else [value]
        return tuple(context)

    def _offsets(self, name: str, n_q: int, n_k: int, device: torch.device) -> torch.Tensor:
        """The int32 table of an index over the offsets key - query = 1 - n_q .. n_k - 1 (one entry at least),
        computed in float64 by the generated function `name`; kept per sizes and device (a few)."""
        key = (name, n_q, n_k, device)
        table = self._offset_tables.get(key)
        if table is None:
            offsets = torch.arange(1 - n_q, max(n_k, 2 - n_q), dtype=torch.float64, device=device)
            table = self.ns[name](offsets, device).contiguous()
            if len(self._offset_tables) >= 16:
                self._offset_tables.clear()
            self._offset_tables[key] = table
        return table

    def _tables(self, q: torch.Tensor, k: torch.Tensor, context: tuple, columns: bool) -> list[Any]:
        """The rows table's and the columns table's (pointer, strides) for the range hooks (cached per mask)."""
        assert self.tables is not None
        ns, (by_batch, by_head) = self.ns, self.tables
        sizes = (q.shape[2], k.shape[2], q.shape[0], q.shape[1])
        rows = mask_table.row_ranges(ns["_mask"], context, *sizes, by_batch=by_batch, by_head=by_head,
                                     outer=ns["_key_bound"], device=q.device)
        cols = mask_table.col_ranges(ns["_mask"], context, *sizes, by_batch=by_batch, by_head=by_head,
                                     outer=ns["_query_bound"], rows=rows, device=q.device) if columns else rows
        return [*mask_table.table_context(rows), *mask_table.table_context(cols)]

    def _grad_buffers(self, tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], tuple]:
        """Zeroed fp32 buffers for the modifier tensors that take a gradient, and G (pointers and strides)."""
        buffers = [torch.zeros(t.shape, dtype=torch.float32, device=t.device)
                   for t, (_, _, grad) in zip(tensors, self.mod_tensors, strict=True) if grad]
        return buffers, tuple(x for b in buffers for x in (b, *b.stride()))

    def _split(self, rest: Sequence[Any]) -> tuple[Sequence[torch.Tensor], Sequence[Any]]:
        n = len(self.mod_tensors)
        return rest[:n], rest[n:]

    def _forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: Any, scale: float, *rest: Any) -> tuple:
        sink = rest[-1] if self.sink_tensor else None
        tensors, constants = self._split(rest[:-1] if self.sink_tensor else rest)
        context = self._context(q, k, tensors, constants)
        mode = self.ns["CONFIG"].decode
        if mode == "always" or (mode == "auto" and kernel_decode.use_decode(q.shape[2], k.shape[2],
                                                                             q.shape[0] * q.shape[1])):
            # few queries, many keys: the key axis split across programs, merged by the certificate (and the sink
            # merged after them, from an fp32 o, so that o is rounded once)
            wide = torch.float32 if self.sink is not None else None
            o, (z, m) = kernel_decode.decode_forward(self.ns["KERNELS"], q, k, v, w, scale, context, out_dtype=wide)
            if self.sink is not None:
                o = kernel_sink.merge(self.ns["KERNELS"], o, z, m, sink, self.sink[1], self.sink[2],
                                      self.ns.get("_sink_map"), q.dtype)
        elif self.sink is not None:  # the stream starts from the sink's state
            rows = (q.shape[0], q.shape[1], q.shape[2])
            start = kernel_sink.forward_sink(sink, self.sink[1], rows, self.sink[2], self.ns.get("_sink_map"))
            o, (z, m) = self.ns["forward"](q, k, v, w, scale, context, sink=start)
        else:
            o, (z, m) = self.ns["forward"](q, k, v, w, scale, context)
        return o, z, m

    def _forward_lse(self, *args: Any) -> tuple:
        o, z, m = self._forward(*args)
        lse = torch.log(torch.where(z > 0, z, 1.0))
        if self.stat_rate and m is not None:
            lse = lse + self.stat_rate * m
        return o, torch.where(z > 0, lse, float("-inf")), z, m

    def _fake_lse(self, *args: Any) -> tuple:
        o, z, m = self._fake(*args)
        return o, torch.empty_like(z), z, m

    def _backward_lse(self, grads: tuple, saved: tuple, constants: tuple, needs: tuple, stash: Any) -> tuple:
        """d lse_i / d z_i = 1 / z_i (z relative to the running max, as the kernels keep it): the kernels' delta,
        -dL/dz, takes -g_i / z_i more (`delta_in`)."""
        do, dlse = grads
        o, z = saved[-3], saved[-2]
        if do is None:
            do = torch.zeros_like(o)
        if dlse is None:
            return self._backward((do,), saved, constants, needs, stash)
        delta_in = torch.where(z != 0, -dlse.float() / torch.where(z != 0, z, 1.0), 0.0)
        return self._backward((do,), saved, constants, needs, stash, delta_in)

    def _fake(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: Any, scale: float, *rest: Any) -> tuple:
        rows = (q.shape[0], q.shape[1], q.shape[2])
        z = q.new_empty(rows, dtype=torch.float32)
        m = q.new_empty(rows if self.ns["ONLINE_MAX"] else (0,), dtype=torch.float32)
        return q.new_empty((*rows, v.shape[3])), z, m

    def _forward_factorized(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: Any, scale: float) -> tuple:
        o, (z, h, vec) = self.ns["forward_factorized"](q, k, v, w, scale)
        return o, z, h, vec

    def _fake_factorized(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: Any, scale: float) -> tuple:
        ns = self.ns
        batch, hq, n_q, head_dim = q.shape
        states = (n_q + ns["CHUNK"] - 1) // ns["CHUNK"] if ns["FACT_CAUSAL"] else 1
        tile = ns["head_tile"](head_dim)
        h = q.new_empty((batch * k.shape[1], states, tile, 2 * tile))
        vec = q.new_empty((batch * k.shape[1], states, 2 * tile) if ns["FACT_NEED_VEC"] else (0,),
                          dtype=torch.float32)
        return q.new_empty((batch, hq, n_q, v.shape[3])), q.new_empty((batch, hq, n_q), dtype=torch.float32), h, vec

    def _weight_gradient(self, do: torch.Tensor, saved: tuple, scale: float, needs: tuple,
                         context: tuple | None = None) -> torch.Tensor | None:
        """The weight's gradient where it needs one, from the same saved z (and m with the running max)."""
        if not needs[3]:
            return None
        q, k, v, w, o, z, *rest = saved
        return self.ns["weight_gradient"](do, q, k, v, w, o, z, rest[0] if self.ns["ONLINE_MAX"] else None, scale,
                                          context)

    def _backward(self, grads: tuple, saved: tuple, constants: tuple, needs: tuple, stash: Any,
                  delta_in: torch.Tensor | None = None) -> tuple:
        (do,) = grads
        scale, *mod_constants = constants
        n = len(self.mod_tensors)
        sinks = saved[4 + n:5 + n] if self.sink_tensor else ()
        mod_tensors, saved = saved[4:4 + n], (*saved[:4], *saved[4 + n + len(sinks):])
        context = self._context(saved[0], saved[1], mod_tensors, mod_constants, columns=True)
        # a modifier tensor's gradient where the caller asked for one (needs: one per argument, after _ARGS); none
        # asked: no buffers, and the kernels leave out their atomic adds (kernel.py)
        wanted = [grad and needs[len(_ARGS) + i] for i, (_, _, grad) in enumerate(self.mod_tensors)]
        buffers, grad_args = self._grad_buffers(mod_tensors) if any(wanted) else ([], ())
        if delta_in is None:
            dq, dk, dv = self.ns["backward_from_saved"](do, *saved, scale, context, grad_args)
        else:
            dq, dk, dv = self.ns["backward_from_saved"](do, *saved, scale, context, grad_args, delta_in)
        mod_grads = iter(buffers)
        raw = [next(mod_grads).to(t.dtype) if grad and buffers else None
               for t, (_, _, grad) in zip(mod_tensors, self.mod_tensors, strict=True)]
        raw = [g if want else None for g, want in zip(raw, wanted, strict=True)]
        dsink = []
        if sinks and self.sink is not None and self.sink[3]:
            o, z, m = saved[4:7]
            dsink = [kernel_sink.gradient(self.ns["KERNELS"], do, o, z, m if self.ns["ONLINE_MAX"] else None,
                                          sinks[0], self.sink[1], self.ns["_sink_map"], self.ns["_dsink_map"], delta_in)
                     if needs[-1] else None]
        return (dq, dk, dv, self._weight_gradient(do, saved, scale, needs, context),
                *[g for g, (_, _, grad) in zip(raw, self.mod_tensors, strict=True) if grad], *dsink)

    def _backward_factorized(self, grads: tuple, saved: tuple, constants: tuple, needs: tuple, stash: Any) -> tuple:
        (do,) = grads
        (scale,) = constants
        dq, dk, dv = self.ns["factorized_backward_from_saved"](do, *saved, scale)
        return dq, dk, dv, self._weight_gradient(do, saved, scale, needs)

    def _backward_fake(self, grads: tuple, saved: tuple, constants: tuple, needs: tuple) -> list:
        q, k, v, w = saved[:4]
        dw = torch.empty_like(w) if needs[3] and w is not None else q.new_empty(0)
        mods = saved[4:4 + len(self.mod_tensors)]
        sink = [torch.empty_like(saved[4 + len(mods)])] if self.sink_tensor and self.sink and self.sink[3] else []
        return [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dw,
                *[torch.empty_like(t) if needs[len(_ARGS) + i] else q.new_empty(0)
                  for i, (t, (_, _, grad)) in enumerate(zip(mods, self.mod_tensors, strict=True)) if grad],
                *sink]

    # --- calls --------------------------------------------------------------------------------------------------

    def check(self, *tensors: torch.Tensor) -> dict[str, int]:
        """The size of every axis (read-only: remembered per call signature, rt.CheckMemo); CallError naming the
        tensor and the axis for a bad shape, dtype or device."""
        signature = None if torch.compiler.is_compiling() else rt.CheckMemo.signature(*tensors)
        remembered = self._checked.get(signature)
        if remembered is not None:
            return remembered  # type: ignore[return-value]
        named = [(name, t, axes) for (name, axes), t in zip(self.inputs, tensors, strict=True)]
        sizes = rt.bind_axes(self.axes, named)
        by_name = {name: t for name, t, _ in named}
        # (an operand a prologue computes, not an input, is checked by the prologue: prologue.py)
        direct = [(role, by_name[role]) for role in (self.query, self.key, self.value) if role in by_name]
        if direct:
            rt.check_floats(direct)
        for name, _, grad in self.mod_tensors:
            t = by_name[name]
            if grad and not t.is_floating_point():
                raise rt.CallError(None, detail=f"{name} has dtype {t.dtype}; the spec declares a float tensor")
            if not grad and (t.is_floating_point() or t.is_complex()):
                raise rt.CallError(None, detail=f"{name} has dtype {t.dtype}; the spec declares an integer tensor "
                                   "(pass torch.int32 or torch.int64 values)")
        sink = self.sink[0] if self.sink is not None else None
        if sink is not None and not by_name[sink].is_floating_point():
            raise rt.CallError(None, detail=f"{sink} (the sink's logits) has dtype {by_name[sink].dtype}; pass a "
                               "float tensor")
        rt.check_device([(name, t) for name, t, _ in named])
        self._checked.put(signature, sizes)
        return sizes

    def _context_parallel(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor | None,
                          scale: float, sink: torch.Tensor | None, return_lse: bool, group: Any,
                          mods: Sequence[Any], sizes: Mapping[str, int]) -> Any:
        """ring.context_parallel, with the modifiers' inputs (`mods`: tensors, then scalars) where the spec has
        them, after the refusals of what it does not carry."""
        whole = dict(group.whole) if isinstance(group, ring.Sharding) else {}
        modifiers = self._ring_modifiers(mods, sizes, whole) if self.ns["KERNELS"].modified else None
        tile = self.ns["head_tile"](q.shape[3])
        factorized = None if self.factorized is None else lambda n_q, n_k: self.ns["_use_factorized"](n_q, n_k, tile)
        sink_spec = None
        if self.sink is not None:
            sink_spec = (self.sink[1], self.sink[2], self.ns.get("_sink_map"), self.ns.get("_dsink_map"))
        return ring.context_parallel(self.ns["KERNELS"], q, k, v, w, scale, group, (self.query, self.key),
                                     factorized, sink=sink, sink_spec=sink_spec, stat_rate=self.stat_rate,
                                     return_lse=return_lse, modifiers=modifiers)

    def _ring_modifiers(self, mods: Sequence[Any], sizes: Mapping[str, int],
                        whole: Mapping[str, torch.Tensor]) -> ring.RingModifiers:
        """The hooks' inputs on the ring: each tensor's query and key dimension (the query one cut to a call's rows,
        the key one travelling with the key shard), the scalars and sizes as one device's op passes them. whole:
        the tensors over both axes as given to ncd.distributed (this rank's queries against every key), in place
        of the views the op's checks saw; each call cuts their key dimension to its keys."""
        tensors, scalars = list(mods[:len(self.mod_tensors)]), mods[len(self.mod_tensors):]
        constants = (*scalars, *(sizes[a] for a in self.mod_sizes))
        axes = dict(self.inputs)
        q_axis, k_axis = self.sequence
        query_dims: list[int | None] = []
        key_dims: list[int | None] = []
        whole_dims: list[int | None] = []
        for i, (name, _, _) in enumerate(self.mod_tensors):
            tensors[i] = whole.get(name, tensors[i])
        wanted = torch.is_grad_enabled() and any(grad and t.requires_grad
                                                 for (_, _, grad), t in zip(self.mod_tensors, tensors, strict=True))
        for name, _, _ in self.mod_tensors:
            dims = axes[name]
            query_dims.append(dims.index(q_axis) if q_axis in dims else None)
            key_dims.append(dims.index(k_axis) if k_axis in dims else None)
            whole_dims.append(None)
            if query_dims[-1] is not None and key_dims[-1] is not None:
                if name not in whole:
                    raise rt.CallError(None, detail=f"{self.spec_name}: {name} [{' '.join(dims)}] under context "
                                       f"parallelism holds this rank's '{q_axis}' positions against every '{k_axis}'",
                                       hint="call the op through ncd.distributed.context_parallel_attention")
                whole_dims[-1], key_dims[-1] = key_dims[-1], None

        def context(q: torch.Tensor, k: torch.Tensor, tensors: Sequence[torch.Tensor], place: tuple,
                    columns: bool) -> tuple:
            built = self._context(q, k, tensors, constants, columns, place)
            assert built is not None
            return built

        def bounds(q: torch.Tensor, k: torch.Tensor, tensors: Sequence[torch.Tensor], place: tuple) -> tuple:
            return self.base_context(q, k, tensors, constants, place)

        # the keys a block of rows may see: the range hook, or its compile-time bound where it reads call-time tables
        key_bound = self.ns["_key_bound" if self.tables is not None else "_key_range"]
        return ring.RingModifiers(context, tuple(tensors), tuple(query_dims), tuple(key_dims),
                                  tuple(grad for _, _, grad in self.mod_tensors), wanted,
                                  zigzag=self.ns["KERNELS"].mask_hides, key_bound=key_bound, bounds=bounds,
                                  plans=None if self.mask_reads_tensors else self._ring_plans, constants=constants,
                                  whole_key_dims=tuple(whole_dims))

    def _kernel_weight(self, w: torch.Tensor | None, sizes: Mapping[str, int]) -> torch.Tensor | None:
        """The weight as [batch key] float32: a [key] weight is shared by the batch."""
        if w is None:
            return None
        layout = self.weight_layout
        if isinstance(layout, str):  # the batch axis's name: w is [key]
            w = w.unsqueeze(0).expand(sizes[layout], -1)
        elif layout is not None:
            w = w.permute(layout)
        return w.to(torch.float32)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor | None, scale: Any,
                 sizes: Mapping[str, int], *mods: Any, return_lse: bool = False, group: Any = None) -> Any:
        """The output; with return_lse, (output, lse) where lse is the log of each row's sum z (FlashAttention's
        log-sum-exp for softmax) over the output's axes other than the value width, differentiable. group: context
        parallelism over that process group (ring.py), each rank holding a shard of the query and key axes."""
        if self.weight is not None and w is not None and torch.compiler.is_compiling():
            # the weight's gradient kernel runs in eager backwards only
            rt.check_constant(self.weight, w, "the per-key weight under torch.compile")
        if return_lse and self.weight is not None and w is not None and w.requires_grad:
            raise rt.CallError(None, detail=f"return_lse=True with a per-key weight '{self.weight}' that requires "
                               "grad: its gradient kernel does not take the statistic's gradient; detach the weight")
        kq = q.permute(self.perms["q"])
        kk = k.permute(self.perms["k"])
        kv = v.permute(self.perms["v"])
        kw = self._kernel_weight(w, sizes)
        if self.scale_grad is not None:  # a scale that needs a gradient gets it through q (differentiable_scale)
            kernel_scale, kq = rt.differentiable_scale(scale, kq, self.scale_grad)
        else:
            kernel_scale = float(scale)
        inverse = self.perms["o_inverse"]
        rows = [d for d in inverse if d != 3]  # lse: the output's axes without the value width, in the spec's order
        if group is not None:
            result = self._context_parallel(kq, kk, kv, kw, kernel_scale, mods[-1] if self.sink_tensor else None,
                                            return_lse, group, mods[:-1] if self.sink_tensor else mods, sizes)
            return (result[0].permute(inverse), result[1].permute(rows)) if return_lse else result.permute(inverse)
        if 0 in kq.shape or 0 in kk.shape:  # empty batch, heads, queries, keys or head dim: nothing to launch
            # (no keys: every row is masked, so 0, as docs/language.md defines; its lse is -inf)
            o = rt.zero_result((kq.shape[0], kq.shape[1], kq.shape[2], kv.shape[3]), kq, kq, kk, kv, kw)
            if return_lse:
                return o.permute(inverse), torch.full(kq.shape[:3], float("-inf"), device=kq.device).permute(rows)
            return o.permute(inverse)
        # the modifiers' tensors and scalars, their sizes, then the sink's logits
        sized = (*(sizes[a] for a in self.mod_sizes),)
        args = (*mods[:-1], *sized, mods[-1]) if self.sink_tensor else (*mods, *sized)
        if return_lse:
            o, lse, _, _ = self.with_lse(kq, kk, kv, kw, kernel_scale, *args)
            return o.permute(inverse), lse.permute(rows)
        op = self.streamed
        if self.factorized is not None and self.ns["_use_factorized"](kq.shape[2], kk.shape[2],
                                                                      self.ns["head_tile"](kq.shape[3])):
            op = self.factorized  # the kernels' work is at the head tile
        return op(kq, kk, kv, kw, kernel_scale, *args)[0].permute(inverse)
