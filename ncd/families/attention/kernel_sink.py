"""Attention sinks: one more entry of the normalised axis, with a logit and no value, merged by the certificate.

A sink logit sigma (a per-head `param`, or the constant of softmax-plus-one, `b(z) = 1 + z`) adds a2(sigma) to
the normaliser and nothing to the numerator: o_i = sum_j a1(s_ij) v_j / b(sum_j a2(s_ij) + a2(sigma_i)). It is a
partial state of the streamed accumulator, (acc, z, m) = (0, a2(0), u) at its place u in the maps' domain
(sinks.py), so it joins the streamed rows' state by the certificate's merge, the combine of split-K decoding:

    m' = max(m, u),  acc' = acc a1(m - m'),  z' = z a2(m - m') + a2(u - m')        (running max)
    z' = z + u                                                                      (plain sums: u = a2(sigma))

The streamed forward starts each row from that state (`forward_sink`: kernel.py's SINK), so o comes out merged,
rounded once and stored by bulk copies. `merge` applies it to a finished forward instead (o = acc / b(z) comes
back as o b(z) a1(m - m') / b(z')), for the split-K decoding path. Either way the saved (z', m') make the backward
kernels' P and delta include the sink unchanged:
its value is 0, so it adds nothing to dV, dQ or dK. Its own gradient is that of a key with v = 0:
d sigma_i = -delta_i u'(sigma_i) (times a2'(u - m') with the running max), delta_i = (dO_i . o_i) b'(z') / b(z')
(`gradient`)."""

# ruff: noqa: E741
# (kernels: the output named O, as in kernel.py)
from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from ncd.families.attention.kernel import (
    _head,
    _load_rows,
    _row_delta,
    _row_program,
    _store_rows,
    head_tile,
    sink_place,
)

BLOCK_ROWS = 32


@triton.jit
def sink_merge_kernel(
    O, OUT, Z, M, T, stride_ob, stride_oh, stride_om, stride_od, stride_tb, stride_th, stride_tm, u_const, HQ, N_Q,
    HEAD_DIM_V: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr,
    A1: tl.constexpr, A2: tl.constexpr, B: tl.constexpr, SINK_MAP: tl.constexpr,
    ONLINE_MAX: tl.constexpr, HAS_T: tl.constexpr,
):
    """o of a block of rows merged with the sink's state into OUT (same strides; module docstring), z and m in
    place. A row that saw no key (z = 0) keeps o = 0 and takes the sink's state alone."""
    bh, off_b, off_h, rows, in_q, offs_d, d_ok = _row_program(HQ, N_Q, BLOCK_M, HEAD_DIM_V, DV)
    o_base = _head(O, off_b, off_h, stride_ob, stride_oh)
    o = _load_rows(o_base, rows, stride_om, stride_od, offs_d, in_q, d_ok).to(tl.float32)
    stat = bh.to(tl.int64) * N_Q + rows
    z = tl.load(Z + stat, mask=in_q, other=0.0)
    u, _ = sink_place(T, off_b, off_h, rows, in_q, stride_tb, stride_th, stride_tm, u_const, SINK_MAP, HAS_T)
    seen = z != 0
    safe_z = tl.where(seen, z, 1.0)
    if ONLINE_MAX:
        m = tl.load(M + stat, mask=in_q, other=0.0)
        m_new = tl.where(seen, tl.maximum(m, u), u)
        shift = tl.where(seen, m - m_new, 0.0)
        z_new = tl.where(seen, z * A2(shift), 0.0) + A2(u - m_new)
        factor = B(safe_z) * A1(shift) / B(z_new)
        tl.store(M + stat, m_new, mask=in_q)
    else:
        z_new = z + u
        factor = B(safe_z) / B(tl.where(z_new != 0, z_new, 1.0))
    o = tl.where(seen[:, None], o * factor[:, None], 0.0)
    _store_rows(_head(OUT, off_b, off_h, stride_ob, stride_oh), o.to(OUT.dtype.element_ty), rows, stride_om,
                stride_od, offs_d, in_q, d_ok)
    tl.store(Z + stat, z_new, mask=in_q)


@triton.jit
def sink_grad_kernel(
    O, DO, Z, M, T, DT, DELTA, stride_ob, stride_oh, stride_om, stride_od,
    stride_dob, stride_doh, stride_dom, stride_dod, stride_tb, stride_th, stride_tm, HQ, N_Q,
    HEAD_DIM_V: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr,
    DA2: tl.constexpr, DB_OVER_B: tl.constexpr, SINK_MAP: tl.constexpr, DSINK_MAP: tl.constexpr,
    ONLINE_MAX: tl.constexpr, DELTA_IN: tl.constexpr,
):
    """d sigma per row, fp32 [B, H, N_Q]: -delta u'(sigma), times a2'(u - m) with the running max (module
    docstring)."""
    bh, off_b, off_h, rows, in_q, offs_d, d_ok = _row_program(HQ, N_Q, BLOCK_M, HEAD_DIM_V, DV)
    o = _load_rows(_head(O, off_b, off_h, stride_ob, stride_oh), rows, stride_om, stride_od, offs_d, in_q, d_ok)
    do = _load_rows(_head(DO, off_b, off_h, stride_dob, stride_doh), rows, stride_dom, stride_dod, offs_d, in_q,
                    d_ok)
    stat = bh.to(tl.int64) * N_Q + rows
    z = tl.load(Z + stat, mask=in_q, other=1.0)
    delta = _row_delta(o, do, z, DB_OVER_B)
    if DELTA_IN:  # the row statistic's own gradient (runtime.py)
        delta += tl.load(DELTA + stat, mask=in_q, other=0.0)
    u, sigma = sink_place(T, off_b, off_h, rows, in_q, stride_tb, stride_th, stride_tm, 0.0, SINK_MAP, True)
    dsigma = -delta * DSINK_MAP(sigma)
    if ONLINE_MAX:
        dsigma = dsigma * DA2(u - tl.load(M + stat, mask=in_q, other=0.0))
    tl.store(DT + stat, dsigma, mask=in_q)


def _rows_view(sink: torch.Tensor | None, dims: tuple[int, ...], rows: tuple[int, int, int]) -> torch.Tensor | None:
    """The sink tensor as a [B, H, N_Q] view (stride 0 along the row axes it lacks); dims: each of its dimensions'
    position among (batch, head, query)."""
    if sink is None:
        return None
    shape = [1, 1, 1]
    for d, size in zip(dims, sink.shape, strict=True):
        shape[d] = size
    order = sorted(range(len(dims)), key=lambda d: dims[d])
    return sink.permute(order).reshape(shape).expand(rows)


def forward_sink(sink: torch.Tensor | None, dims: tuple[int, ...], rows: tuple[int, int, int], constant: float,
                 sink_map: Any = None) -> tuple:
    """The streamed forward's `sink` argument (kernel.py: its stream starts from the sink's state, so no merge
    follows): the logits as a [B, H, N_Q] view (or None: the constant place), the place, u(logit)."""
    return _rows_view(sink, dims, rows), constant, sink_map


def merge(kernels: Any, o: torch.Tensor, z: torch.Tensor, m: torch.Tensor | None, sink: torch.Tensor | None,
          dims: tuple[int, ...], constant: float, sink_map: Any = None, dtype: torch.dtype | None = None
          ) -> torch.Tensor:
    """Merge the sink into a finished forward's o (returned anew, in `dtype`: the forward leaves o in fp32 so that
    it is rounded once), z and m (in place). sink: the logit tensor (dims: its dimensions' positions among batch,
    head, query; sink_map: its u(sigma), sinks.py), or None for the constant place `constant`."""
    batch, hq, n_q, dv = o.shape
    out = kernels.new(o.shape, dtype or o.dtype, o.device)
    assert out.stride() == o.stride()
    view = _rows_view(sink, dims, (batch, hq, n_q))
    t_arg, t_strides = (view, view.stride()) if view is not None else (z, (0, 0, 0))
    maps = kernels.maps
    sink_merge_kernel[(triton.cdiv(n_q, BLOCK_ROWS), batch * hq)](
        o, out, z, m if m is not None else z, t_arg, *o.stride(), *t_strides, float(constant), hq, n_q,
        HEAD_DIM_V=head_tile(dv), DV=dv, BLOCK_M=BLOCK_ROWS, A1=maps["A1"], A2=maps["A2"], B=maps["B"],
        SINK_MAP=sink_map or maps["A1"], ONLINE_MAX=kernels.config.online_max, HAS_T=view is not None,
    )
    return out


def gradient(kernels: Any, do: torch.Tensor, o: torch.Tensor, z: torch.Tensor, m: torch.Tensor | None,
             sink: torch.Tensor, dims: tuple[int, ...], sink_map: Any, dsink_map: Any,
             delta_in: torch.Tensor | None = None) -> torch.Tensor:
    """The sink tensor's gradient, in its own shape and dtype: the per-row d sigma summed over the row axes it
    lacks. delta_in: added to each row's delta, as the backward kernels take it."""
    batch, hq, n_q, dv = o.shape
    view = _rows_view(sink, dims, (batch, hq, n_q))
    assert view is not None
    if do.dtype != o.dtype:
        do = do.to(o.dtype)
    dt = torch.empty((batch, hq, n_q), dtype=torch.float32, device=o.device)
    maps = kernels.maps
    sink_grad_kernel[(triton.cdiv(n_q, BLOCK_ROWS), batch * hq)](
        o, do, z, m if m is not None else z, view, dt, delta_in if delta_in is not None else z, *o.stride(),
        *do.stride(), *view.stride(), hq, n_q,
        HEAD_DIM_V=head_tile(dv), DV=dv, BLOCK_M=BLOCK_ROWS, DA2=maps["DA2"], DB_OVER_B=maps["DB_OVER_B"],
        SINK_MAP=sink_map, DSINK_MAP=dsink_map, ONLINE_MAX=kernels.config.online_max, DELTA_IN=delta_in is not None,
    )
    lacking = [d for d in range(3) if d not in dims]
    total = dt.sum(lacking) if lacking else dt
    present = sorted(dims)  # back to the sink's own dimension order
    return total.permute([present.index(d) for d in dims]).to(sink.dtype)
