"""Static parts of the polynomial-KAN family: the launch decisions (`tiling`, read by the planner for `--emit plan`
and by the generated modules at run time, so generated code never imports the planner), the plan's `PolyKANConfig`,
and the kernels that do not depend on the spec (operand splitting and the GEMM regime's split-product GEMMs).

The basis evaluation and the fused forward / backward are static too: the spec's scalar maps and basis recurrence
enter as `tl.constexpr` device functions of the generated module (`PolyKANHooks`), and `PolyKANRuntime` binds
them to one op's launchers, per-size plans and workspace.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from ncd import settings as _settings
from ncd.launch import BoundKernel, sm_count

from .config import PolyKANConfig, tiling

_INTERP = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def parts(v, BF16: tl.constexpr):
    # v = hi + lo with hi exact in the dot's input type: bf16 (rounded) or TF32 (13 low mantissa bits cleared)
    if BF16:
        hi = v.to(tl.bfloat16)
        lo = (v - hi.to(tl.float32)).to(tl.bfloat16)
    else:
        hi = (v.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
        lo = v - hi
    return hi, lo


@triton.jit
def dot3(ah, al, bh, bl, acc, BF16: tl.constexpr, PREC: tl.constexpr):
    # a.b to about fp32 accuracy from split parts: the small products first, lo.lo dropped
    if BF16:
        if _INTERP:  # the interpreter's bf16 dot is unreliable: same parts, fp32 products
            ah, al, bh, bl = ah.to(tl.float32), al.to(tl.float32), bh.to(tl.float32), bl.to(tl.float32)
            acc = tl.dot(ah, bl, acc, input_precision="ieee")
            acc = tl.dot(al, bh, acc, input_precision="ieee")
            acc = tl.dot(ah, bh, acc, input_precision="ieee")
        else:
            acc = tl.dot(ah, bl, acc)
            acc = tl.dot(al, bh, acc)
            acc = tl.dot(ah, bh, acc)
    else:
        acc = tl.dot(ah, bl, acc, input_precision=PREC)
        acc = tl.dot(al, bh, acc, input_precision=PREC)
        acc = tl.dot(ah, bh, acc, input_precision=PREC)
    return acc



@triton.jit
def split(src_ptr, hi_ptr, lo_ptr, thi_ptr, tlo_ptr, R, CC,
           BR: tl.constexpr, BC: tl.constexpr, BF16: tl.constexpr, WRITE_N: tl.constexpr, WRITE_T: tl.constexpr):
    # src [R, CC] -> parts [R, CC] and / or transposed parts [CC, R]
    rr = tl.program_id(0) * BR + tl.arange(0, BR)
    rc = tl.program_id(1) * BC + tl.arange(0, BC)
    m = (rr < R)[:, None] & (rc < CC)[None, :]
    v = tl.load(src_ptr + rr[:, None] * CC + rc[None, :], mask=m, other=0.0)
    hi, lo = parts(v, BF16)
    if WRITE_N:
        tl.store(hi_ptr + rr[:, None] * CC + rc[None, :], hi, mask=m)
        tl.store(lo_ptr + rr[:, None] * CC + rc[None, :], lo, mask=m)
    if WRITE_T:
        tl.store(thi_ptr + rc[None, :] * R + rr[:, None], hi, mask=m)
        tl.store(tlo_ptr + rc[None, :] * R + rr[:, None], lo, mask=m)


@triton.jit
def gemm(ah_ptr, al_ptr, bh_ptr, bl_ptr, out_ptr, M, N, K,
          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr, KCHUNK: tl.constexpr,
          BF16: tl.constexpr, PREC: tl.constexpr):
    # out[M, N] = A[M, K] . B[N, K]^T, both operands K-major (row-major with K contiguous), given as parts.
    # The tensor-core accumulator is flushed into an fp32 register sum every KCHUNK of K: its error grows
    # with the length of the chain it accumulates.
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BM)
    grid_n = tl.cdiv(N, BN)
    width = GROUP * grid_n
    first_m = (pid // width) * GROUP
    size_m = tl.minimum(grid_m - first_m, GROUP)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    am = rm < M
    bn = rn < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kc in range(0, K, KCHUNK):
        part = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(kc, tl.minimum(K, kc + KCHUNK), BK):
            km = rk < K - k0
            ma = am[:, None] & km[None, :]
            mb = km[:, None] & bn[None, :]
            a_off = rm[:, None] * K + (k0 + rk)[None, :]
            b_off = rn[None, :] * K + (k0 + rk)[:, None]
            ah = tl.load(ah_ptr + a_off, mask=ma, other=0.0)
            al = tl.load(al_ptr + a_off, mask=ma, other=0.0)
            bh = tl.load(bh_ptr + b_off, mask=mb, other=0.0)
            bl = tl.load(bl_ptr + b_off, mask=mb, other=0.0)
            part = dot3(ah, al, bh, bl, part, BF16, PREC)
        acc += part
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc, mask=am[:, None] & bn[None, :])


@triton.jit
def dx_gemm(dyh_ptr, dyl_ptr, ch_ptr, cl_ptr, dp_ptr, dx_ptr, B, I, O,  # noqa: E741
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr, KCHUNK: tl.constexpr,
             BF16: tl.constexpr, PREC: tl.constexpr, DEGREES: tl.constexpr):
    # dx[b, i] = sum_d dPhi[b, d, i] sum_o dy[b, o] C[d, i, o]: per degree one GEMM dy . C_d^T (K = O, both
    # K-major), the degree sum in the epilogue with P'_d du/dx from the basis kernel (accumulators flushed
    # every KCHUNK of K and at every degree)
    pid = tl.program_id(0)
    grid_m = tl.cdiv(B, BM)
    grid_n = tl.cdiv(I, BN)
    width = GROUP * grid_n
    first_m = (pid // width) * GROUP
    size_m = tl.minimum(grid_m - first_m, GROUP)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    am = rm < B
    bn = rn < I
    dxacc = tl.zeros((BM, BN), dtype=tl.float32)
    for d in range(0, DEGREES):
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kc in range(0, O, KCHUNK):
            part = tl.zeros((BM, BN), dtype=tl.float32)
            for k0 in range(kc, tl.minimum(O, kc + KCHUNK), BK):
                km = rk < O - k0
                ma = am[:, None] & km[None, :]
                mb = km[:, None] & bn[None, :]
                a_off = rm[:, None] * O + (k0 + rk)[None, :]
                b_off = d * I * O + rn[None, :] * O + (k0 + rk)[:, None]
                ah = tl.load(dyh_ptr + a_off, mask=ma, other=0.0)
                al = tl.load(dyl_ptr + a_off, mask=ma, other=0.0)
                bh = tl.load(ch_ptr + b_off, mask=mb, other=0.0)
                bl = tl.load(cl_ptr + b_off, mask=mb, other=0.0)
                part = dot3(ah, al, bh, bl, part, BF16, PREC)
            acc += part
        dp = tl.load(dp_ptr + rm[:, None] * (DEGREES * I) + d * I + rn[None, :], mask=am[:, None] & bn[None, :],
                     other=0.0)
        dxacc += acc * dp
    tl.store(dx_ptr + rm[:, None] * I + rn[None, :], dxacc, mask=am[:, None] & bn[None, :])


# ---------------------------------------------------------------------------------------------------------------
# The basis, the fused forward and the fused backward. What the spec decides enters as constexprs: the hooks ARG
# (u of x), DARG (du/dx), NEXT / DNEXT (P_d and P'_d from the carried terms, a tuple as deep as the recurrence
# reads back), ZEROS and SHIFT (that tuple's start and step), LUT_POS (the table position of u, LUT mode), and
# DEGREES, LUT (lookup table or recurrence) and NCONST (leading constant basis terms, read exactly from the table).
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def lerp(tab, idx, frac, d, nconst, DEGREES: tl.constexpr):
    # linear interpolation of column d of an [ENTRIES, DEGREES] table
    # the first nconst columns are constants of the recurrence (P_d free of u): exact, even at a NaN u
    base = tab + idx * DEGREES + d
    lo = tl.load(base)
    hi = tl.load(base + DEGREES)
    return lo + tl.where(d < nconst, 0.0, frac) * (hi - lo)


@triton.jit
def basis(x_ptr, tab_ptr, dtab_ptr, ph_ptr, pl_ptr, pth_ptr, ptl_ptr, dp_ptr, B, I,  # noqa: E741
          BB: tl.constexpr, BI: tl.constexpr, SPLIT: tl.constexpr, WRITE_P: tl.constexpr,
          WRITE_T: tl.constexpr, WRITE_D: tl.constexpr, DEGREES: tl.constexpr, LUT: tl.constexpr,
          NCONST: tl.constexpr, ARG: tl.constexpr, DARG: tl.constexpr, NEXT: tl.constexpr, DNEXT: tl.constexpr,
          ZEROS: tl.constexpr, SHIFT: tl.constexpr, LUT_POS: tl.constexpr):
    # Basis, once per element: Phi[b, d, i] = P_d(u) and dPhi[b, d, i] = P'_d(u) du/dx. SPLIT 0: Phi in fp32
    # (fused regime); 1 / 2: Phi as tf32 / bf16 parts, optionally also transposed [d*I + i, b] (the dC GEMM's
    # K-major operand)
    rb = tl.program_id(0) * BB + tl.arange(0, BB)
    ri = tl.program_id(1) * BI + tl.arange(0, BI)
    m = (rb < B)[:, None] & (ri < I)[None, :]
    xv = tl.load(x_ptr + rb[:, None] * I + ri[None, :], mask=m, other=0.0)
    u = ARG(xv)
    dg = DARG(xv)
    if LUT:
        idx, frac = LUT_POS(u)
    else:
        q = ZEROS(BB, BI)
        dq = ZEROS(BB, BI)
    for d in range(0, DEGREES):
        if LUT:  # noqa: SIM108  (a constexpr branch: only the taken side is compiled)
            phi = lerp(tab_ptr, idx, frac, d, NCONST, DEGREES)
        else:
            phi = NEXT(u, d, q)
        if WRITE_D:
            if LUT:
                dphi = lerp(dtab_ptr, idx, frac, d, 0, DEGREES)
            else:
                dphi = DNEXT(u, d, q, dq)
                dq = SHIFT(dq, dphi)
            tl.store(dp_ptr + rb[:, None] * (DEGREES * I) + d * I + ri[None, :], dphi * dg, mask=m)
        if not LUT:
            q = SHIFT(q, phi)
        if WRITE_P:
            if SPLIT == 0:
                tl.store(ph_ptr + rb[:, None] * (DEGREES * I) + d * I + ri[None, :], phi, mask=m)
            else:
                hi, lo = parts(phi, SPLIT == 2)
                tl.store(ph_ptr + rb[:, None] * (DEGREES * I) + d * I + ri[None, :], hi, mask=m)
                tl.store(pl_ptr + rb[:, None] * (DEGREES * I) + d * I + ri[None, :], lo, mask=m)
        if WRITE_T:
            hi, lo = parts(phi, SPLIT == 2)
            tl.store(pth_ptr + (d * I + ri[None, :]) * B + rb[:, None], hi, mask=m)
            tl.store(ptl_ptr + (d * I + ri[None, :]) * B + rb[:, None], lo, mask=m)


@triton.jit
def lut_slice(x_ptr, tab_ptr, dtab_ptr, phi_ptr, dphi_ptr, rm, mm, i_lo, i_hi, I, d_lo, d_step,  # noqa: E741
              BM: tl.constexpr, BI: tl.constexpr, WRITE_D: tl.constexpr, DEGREES: tl.constexpr,
              NCONST: tl.constexpr, ARG: tl.constexpr, DARG: tl.constexpr, LUT_POS: tl.constexpr):
    # Phi[b, d, i] (and dPhi = P'_d du/dx) for rows rm, inputs [i_lo, i_hi), degrees d_lo, d_lo + d_step, ...
    for i0 in range(i_lo, i_hi, BI):
        ri = i0 + tl.arange(0, BI)
        m = mm[:, None] & (ri < i_hi)[None, :]
        xv = tl.load(x_ptr + rm[:, None] * I + ri[None, :], mask=m, other=0.0)
        idx, frac = LUT_POS(ARG(xv))
        dg = DARG(xv)
        for d in range(d_lo, DEGREES, d_step):
            off = rm[:, None] * (DEGREES * I) + d * I + ri[None, :]
            tl.store(phi_ptr + off, lerp(tab_ptr, idx, frac, d, NCONST, DEGREES), mask=m)
            if WRITE_D:
                tl.store(dphi_ptr + off, lerp(dtab_ptr, idx, frac, d, 0, DEGREES) * dg, mask=m)


# Fused forward: y[b, o] = sum_{i, d} P_d(u[b, i]) C[d, i, o]; grid (output tiles, splits of the input axis);
# split-K partials combined by the last-arriving program.
# LUT mode, still one launch, the table read once per element: the programs sharing a (batch tile, split)
# group (one per output tile, consecutive tickets taken in start order) each evaluate a share of the degrees
# of the group's slice into Phi (and P' du/dx into dPhi when the backward needs it), arrive on the group's
# counter, and wait until every member of this launch has arrived (counter = epoch x members); then all read
# Phi. A member that does not see the count after a bounded spin evaluates every degree itself (identical
# values), so progress never depends on scheduling.
@triton.jit(do_not_specialize=["EPOCH"])
def fwd_fused(x_ptr, c_ptr, phi_ptr, dphi_ptr, tab_ptr, dtab_ptr, y_ptr, ws_ptr, cnt_ptr, flag_ptr,
              B, I, O, I_PER_SPLIT, TILES_N, SPLIT, TICKET, EPOCH,  # noqa: E741
              BM: tl.constexpr, BN: tl.constexpr, BI: tl.constexpr, WRITE_D: tl.constexpr, SPINS: tl.constexpr,
              FALLBACK: tl.constexpr, PREC: tl.constexpr, DEGREES: tl.constexpr, LUT: tl.constexpr,
              NCONST: tl.constexpr, ARG: tl.constexpr, NEXT: tl.constexpr, ZEROS: tl.constexpr,
              SHIFT: tl.constexpr, DARG: tl.constexpr, LUT_POS: tl.constexpr):
    if LUT:
        # ticket order = start order; tickets run n-tile fastest, so a group's members take consecutive tickets
        ticket = tl.atomic_add(cnt_ptr + TICKET, 1, sem="acq_rel", scope="gpu")
        if ticket == tl.num_programs(0) * tl.num_programs(1) - 1:
            tl.atomic_xchg(cnt_ptr + TICKET, 0)  # every ticket is taken: ready for the next launch
        pid_n = ticket % TILES_N
        group = ticket // TILES_N
        pid_s = group % SPLIT
        pid_m = group // SPLIT
        pid_t = pid_m * TILES_N + pid_n
    else:
        pid_t = tl.program_id(0)
        pid_s = tl.program_id(1)
        pid_m = pid_t // TILES_N
        pid_n = pid_t % TILES_N
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    mm = rm < B
    mn = rn < O
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    i_lo = pid_s * I_PER_SPLIT
    i_hi = tl.minimum(I, i_lo + I_PER_SPLIT)
    if LUT:
        # this member's share of the degrees, then arrive and wait for the whole group of this launch
        lut_slice(x_ptr, tab_ptr, dtab_ptr, phi_ptr, dphi_ptr, rm, mm, i_lo, i_hi, I, pid_n, TILES_N, BM, BI, WRITE_D,
                  DEGREES, NCONST, ARG, DARG, LUT_POS)
        tl.debug_barrier()  # every thread's share is written before the arrival (release, gpu scope)
        seen = tl.atomic_add(flag_ptr + group, 1, sem="acq_rel", scope="gpu") + 1
        target = EPOCH * TILES_N
        spins = 0
        while (seen < target) & (spins < SPINS):
            seen = tl.atomic_add(flag_ptr + group, 0, sem="acquire", scope="gpu")
            spins += 1
        if FALLBACK and seen < target:  # not everyone in time: evaluate every degree here (identical values)
            lut_slice(x_ptr, tab_ptr, dtab_ptr, phi_ptr, dphi_ptr, rm, mm, i_lo, i_hi, I, 0, 1, BM, BI, WRITE_D,
                      DEGREES, NCONST, ARG, DARG, LUT_POS)
        tl.debug_barrier()
    for i0 in range(i_lo, i_hi, BI):
        ri = i0 + tl.arange(0, BI)
        mi = ri < i_hi
        if LUT:
            for d in range(0, DEGREES):  # Phi evaluated once per element above, read back from L2
                phi = tl.load(phi_ptr + rm[:, None] * (DEGREES * I) + d * I + ri[None, :],
                              mask=mm[:, None] & mi[None, :], other=0.0, cache_modifier=".cg")
                c = tl.load(c_ptr + d * I * O + ri[:, None] * O + rn[None, :], mask=mi[:, None] & mn[None, :],
                            other=0.0)
                acc = tl.dot(phi, c, acc, input_precision=PREC)
        else:
            xv = tl.load(x_ptr + rm[:, None] * I + ri[None, :], mask=mm[:, None] & mi[None, :], other=0.0)
            u = ARG(xv)
            q = ZEROS(BM, BI)
            for d in range(0, DEGREES):  # the recurrence carried through the degree loop
                phi = NEXT(u, d, q)
                q = SHIFT(q, phi)
                c = tl.load(c_ptr + d * I * O + ri[:, None] * O + rn[None, :], mask=mi[:, None] & mn[None, :],
                            other=0.0)
                acc = tl.dot(phi, c, acc, input_precision=PREC)
    out = rm[:, None] * O + rn[None, :]
    mo = mm[:, None] & mn[None, :]
    if SPLIT == 1:
        tl.store(y_ptr + out, acc, mask=mo)
    else:
        tl.store(ws_ptr + pid_s * B * O + out, acc, mask=mo)
        tl.debug_barrier()  # every thread's partial is written before the counter moves (release, gpu scope)
        arrived = tl.atomic_add(cnt_ptr + pid_t, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:  # the last split of this tile: combine in fixed order
            tl.debug_barrier()
            total = tl.zeros((BM, BN), dtype=tl.float32)
            for k in range(0, SPLIT):
                total += tl.load(ws_ptr + k * B * O + out, mask=mo, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + out, total, mask=mo)
            tl.atomic_xchg(cnt_ptr + pid_t, 0)  # ready for the next launch


# Fused backward, one kernel: per (input tile, output tile, batch chunk) and degree d
#   dC[d, i, o]  = sum_b Phi_d[b, i] dy[b, o]                      (partial per batch chunk)
#   dX[b, i]    += (sum_o dy[b, o] C[d, i, o]) P'_d(u[b, i]) du/dx   (partial per output tile)
@triton.jit
def bwd_fused(x_ptr, c_ptr, phi_ptr, dphi_ptr, dy_ptr, dx_ptr, dc_ptr, ws_ptr, cnt_ptr,
              B, I, O, TILES_O, CHUNKS, WSC_OFF, CNT_C_OFF,  # noqa: E741
              BM: tl.constexpr, BI: tl.constexpr, BO: tl.constexpr, NEED_DX: tl.constexpr, NEED_DC: tl.constexpr,
              PREC: tl.constexpr, DEGREES: tl.constexpr, LUT: tl.constexpr, ARG: tl.constexpr, DARG: tl.constexpr,
              NEXT: tl.constexpr, DNEXT: tl.constexpr, ZEROS: tl.constexpr, SHIFT: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_b = tl.program_id(1)
    pid_i = pid_t // TILES_O
    pid_o = pid_t % TILES_O
    rb = pid_b * BM + tl.arange(0, BM)
    ri = pid_i * BI + tl.arange(0, BI)
    ro = pid_o * BO + tl.arange(0, BO)
    mb = rb < B
    mi = ri < I
    mo = ro < O
    mbi = mb[:, None] & mi[None, :]
    mio = mi[:, None] & mo[None, :]
    dyt = tl.load(dy_ptr + rb[:, None] * O + ro[None, :], mask=mb[:, None] & mo[None, :], other=0.0)
    dxacc = tl.zeros((BM, BI), dtype=tl.float32)
    tile_io = ri[:, None] * O + ro[None, :]
    if not LUT:
        xv = tl.load(x_ptr + rb[:, None] * I + ri[None, :], mask=mbi, other=0.0)
        u = ARG(xv)
        q = ZEROS(BM, BI)
        dq = ZEROS(BM, BI)
    for d in range(0, DEGREES):
        if LUT:
            if NEED_DC:
                phi = tl.load(phi_ptr + rb[:, None] * (DEGREES * I) + d * I + ri[None, :], mask=mbi, other=0.0)
            if NEED_DX:
                dphi = tl.load(dphi_ptr + rb[:, None] * (DEGREES * I) + d * I + ri[None, :], mask=mbi, other=0.0)
        else:
            phi = NEXT(u, d, q)
            if NEED_DX:
                dphi = DNEXT(u, d, q, dq)
                dq = SHIFT(dq, dphi)
            q = SHIFT(q, phi)
        if NEED_DC:
            g = tl.dot(tl.trans(phi), dyt, input_precision=PREC)  # [BI, BO]
            if CHUNKS == 1:
                tl.store(dc_ptr + d * I * O + tile_io, g, mask=mio)
            else:
                tl.store(ws_ptr + WSC_OFF + (pid_b * DEGREES + d) * I * O + tile_io, g, mask=mio)
        if NEED_DX:
            c = tl.load(c_ptr + d * I * O + tile_io, mask=mio, other=0.0)
            h = tl.dot(dyt, tl.trans(c), input_precision=PREC)  # [BM, BI]
            dxacc += h * dphi
    if NEED_DX:
        if not LUT:
            dxacc = dxacc * DARG(xv)
        tile_bi = rb[:, None] * I + ri[None, :]
        if TILES_O == 1:
            tl.store(dx_ptr + tile_bi, dxacc, mask=mbi)
        else:
            tl.store(ws_ptr + pid_o * B * I + tile_bi, dxacc, mask=mbi)
            tl.debug_barrier()
            arrived = tl.atomic_add(cnt_ptr + pid_i * CHUNKS + pid_b, 1, sem="acq_rel", scope="gpu")
            if arrived == TILES_O - 1:  # last output tile of this (input tile, batch chunk): fixed-order sum
                tl.debug_barrier()
                total = tl.zeros((BM, BI), dtype=tl.float32)
                for k in range(0, TILES_O):
                    total += tl.load(ws_ptr + k * B * I + tile_bi, mask=mbi, other=0.0, cache_modifier=".cg")
                tl.store(dx_ptr + tile_bi, total, mask=mbi)
                tl.atomic_xchg(cnt_ptr + pid_i * CHUNKS + pid_b, 0)
    if NEED_DC:  # noqa: SIM102  (a constexpr flag, then a run-time test: kept apart)
        if CHUNKS > 1:
            tl.debug_barrier()
            arrived = tl.atomic_add(cnt_ptr + CNT_C_OFF + pid_t, 1, sem="acq_rel", scope="gpu")
            if arrived == CHUNKS - 1:  # last batch chunk of this (input, output) tile: fixed-order sum per degree
                tl.debug_barrier()
                for d in range(0, DEGREES):
                    total = tl.zeros((BI, BO), dtype=tl.float32)
                    for k in range(0, CHUNKS):
                        total += tl.load(ws_ptr + WSC_OFF + (k * DEGREES + d) * I * O + tile_io, mask=mio, other=0.0,
                                         cache_modifier=".cg")
                    tl.store(dc_ptr + d * I * O + tile_io, total, mask=mio)
                tl.atomic_xchg(cnt_ptr + CNT_C_OFF + pid_t, 0)


# ---------------------------------------------------------------------------------------------------------------
# Host side: per-size plans (their kernels launched directly: ncd/launch.py), cached workspace
# ---------------------------------------------------------------------------------------------------------------

_INTERPRET = bool(_INTERP)
_PART_PREC = "ieee" if _INTERPRET else "tf32"  # pre-split fp32 parts: one TF32 product each (hi exact in TF32)
# The platform's values of the config's launch choices it leaves None (PolyKANConfig: regime ... lut_wait_spins)
LAUNCH_DEFAULTS: dict[str, Any] = {
    "lut_wait_spins": 2 if _INTERPRET else 20000, "fused_precision": "ieee" if _INTERPRET else "tf32x3",
    "gemm_kchunk": 32 if _INTERPRET else 1024,
}


@dataclass(frozen=True)
class PolyKANHooks:
    """The generated module's device functions (see the kernels above)."""

    arg: Any
    darg: Any
    next: Any
    dnext: Any
    zeros: Any
    shift: Any
    lut_pos: Any = None  # LUT mode only


def _sms(index: int) -> int:
    return 4 if _INTERPRET else sm_count(torch.device("cuda", index), 4)  # 4: the test sizes split every reduction


def _stream(index: int) -> int:
    return 0 if _INTERPRET else torch._C._cuda_getCurrentRawStream(index)


def _round(n: int) -> int:
    return -(-n // 64) * 64  # workspace regions stay 256-byte aligned


class _Plan:
    """Per problem size (and device, alignment): the tiling, grids and kernel launchers."""

    def __init__(self, runtime: PolyKANRuntime, B: int, I: int, O: int, index: int, like: Any):  # noqa: E741
        knobs = runtime.knob
        config = runtime.config
        split = config.matmul_split
        self.runtime = runtime
        til = tiling(B, I, O, config.degrees, _sms(index), _INTERPRET, split, config.regime,
                     None if _INTERPRET else config.fused_tiles)
        if til.regime == "gemm" and config.gemm_tiles is not None and not _INTERPRET:
            til = dataclasses.replace(til, gemm=config.gemm_tiles)
        self.til = til
        self.fused = til.regime == "fused"
        self.B, self.I, self.O = B, I, O
        bb, bi = til.basis_blocks
        self.basis_grid = (triton.cdiv(B, bb), triton.cdiv(I, bi))
        self._basis: dict = {}
        self._bwd: dict = {}
        self._fwd: dict = {}
        self.prec = knobs("fused_precision")
        if self.fused:
            self.fwd_args = (B, I, O, til.fwd_per_split, til.fwd_tiles_n, til.fwd_split, til.fwd_tiles)
            self.fwd_ws = til.fwd_split * B * O if til.fwd_split > 1 else 0
            self.fwd_cnt = til.fwd_tiles + 1  # combine counters, then the ticket counter (LUT mode)
            # LUT mode: one arrival counter per (batch tile, split) group; after launch e it holds e x members
            self.flags = torch.zeros((til.fwd_tiles // til.fwd_tiles_n * til.fwd_split,), device=like.device,
                                     dtype=torch.int32)
            self.epoch = 0
            n_i = triton.cdiv(I, til.bwd_blocks[1])
            self.wsx = _round(til.bwd_tiles_o * B * I) if til.bwd_tiles_o > 1 else 0
            self.wsc = til.bwd_chunks * config.degrees * I * O if til.bwd_chunks > 1 else 0
            self.cnt_c_off = n_i * til.bwd_chunks
            self.bwd_args = (B, I, O, til.bwd_tiles_o, til.bwd_chunks, self.wsx, self.cnt_c_off)
            self.bwd_cnt = self.cnt_c_off + til.bwd_tiles
        else:
            bm, bn, bk, w, s = til.gemm
            self.bf16 = split == "bf16"
            self.part_dtype = torch.bfloat16 if self.bf16 else torch.float32
            gk = {"BM": bm, "BN": bn, "BK": bk, "GROUP": 8, "KCHUNK": max(bk, knobs("gemm_kchunk")), "BF16": self.bf16,
                  "PREC": _PART_PREC}
            K = config.degrees * I
            self.gemm_fwd = BoundKernel(gemm, (triton.cdiv(B, bm) * triton.cdiv(O, bn),), gk, w, s)
            self.gemm_dc = BoundKernel(gemm, (triton.cdiv(K, bm) * triton.cdiv(O, bn),), gk, w, s)
            self.dx = BoundKernel(dx_gemm, (triton.cdiv(B, bm) * triton.cdiv(I, bn),),
                                  {**gk, "DEGREES": config.degrees}, w, s)
            self._split: dict = {}

    def basis(self, split: int, write_p: bool, write_t: bool, write_d: bool) -> BoundKernel:
        key = (split, write_p, write_t, write_d)
        k = self._basis.get(key)
        if k is None:
            bb, bi = self.til.basis_blocks
            k = self._basis[key] = BoundKernel(basis, self.basis_grid, {
                "BB": bb, "BI": bi, "SPLIT": split, "WRITE_P": write_p, "WRITE_T": write_t, "WRITE_D": write_d,
                **self.runtime.spec_constexprs(basis)}, 1 if _INTERPRET else 4, 1)
        return k

    def fwd(self, write_d: bool) -> BoundKernel:
        k = self._fwd.get(write_d)
        if k is None:
            til = self.til
            bm, bn, bi = til.fwd_blocks
            knobs = self.runtime.knob
            k = self._fwd[write_d] = BoundKernel(fwd_fused, (til.fwd_tiles, til.fwd_split), {
                "BM": bm, "BN": bn, "BI": bi, "WRITE_D": write_d, "SPINS": knobs("lut_wait_spins"),
                "FALLBACK": self.runtime.config.lut_fallback, "PREC": self.prec,
                **self.runtime.spec_constexprs(fwd_fused)},
                til.warps, til.stages)
        return k

    def bwd(self, need_dx: bool, need_dc: bool) -> BoundKernel:
        key = (need_dx, need_dc)
        k = self._bwd.get(key)
        if k is None:
            til = self.til
            bm, bi, bo = til.bwd_blocks
            k = self._bwd[key] = BoundKernel(bwd_fused, (til.bwd_tiles, til.bwd_chunks), {
                "BM": bm, "BI": bi, "BO": bo, "NEED_DX": need_dx, "NEED_DC": need_dc, "PREC": self.prec,
                **self.runtime.spec_constexprs(bwd_fused)}, til.warps, til.stages)
        return k

    def split(self, rows: int, cols: int, write_n: bool, write_t: bool) -> BoundKernel:
        key = (rows, cols, write_n, write_t)
        k = self._split.get(key)
        if k is None:
            b = 16 if _INTERPRET else 64
            k = self._split[key] = BoundKernel(split, (triton.cdiv(rows, b), triton.cdiv(cols, b)), {
                "BR": b, "BC": b, "BF16": self.bf16, "WRITE_N": write_n, "WRITE_T": write_t},
                1 if _INTERPRET else 4, 1)
        return k


class PolyKANRuntime:
    """One op's launchers: the static kernels above bound to its hooks and config (whose launch choices, such as
    the regime, tests and the benchmark change through `Op.with_config`); `plans` holds the per-size plans."""

    def __init__(self, config: PolyKANConfig, hooks: PolyKANHooks, table: torch.Tensor | None = None):
        self.config = config
        self.hooks = hooks
        self.table_host = table  # [2, ENTRIES, DEGREES] fp32 (LUT mode)
        self.plans: dict = {}
        self.buffers: dict = {}  # (device index, stream) -> [fp32 workspace, int32 counters (zero between launches)]
        self.tables: dict = {}
        lut = config.basis_eval == "lut"
        self._constexprs = {
            "DEGREES": config.degrees, "LUT": lut, "NCONST": config.lut_const, "ARG": hooks.arg, "DARG": hooks.darg,
            "NEXT": hooks.next, "DNEXT": hooks.dnext, "ZEROS": hooks.zeros, "SHIFT": hooks.shift,
            "LUT_POS": hooks.lut_pos}

    def knob(self, name: str) -> Any:
        """A launch choice of the config (LAUNCH_DEFAULTS' fields): its value, else the platform's."""
        value = getattr(self.config, name)
        return LAUNCH_DEFAULTS[name] if value is None else value

    def spec_constexprs(self, kernel: Any) -> dict[str, Any]:
        """The spec's constexprs (hooks, degrees, mode) that `kernel` takes."""
        names = kernel.arg_names
        return {k: v for k, v in self._constexprs.items() if k in names}

    def _tables(self, like: torch.Tensor, index: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.table_host is None:
            return None, None
        tables = self.tables.get(index)
        if tables is None:
            tables = self.tables[index] = self.table_host.to(like.device)
        return tables[0], tables[1]

    def _empty(self, shape: tuple, like: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        out = like.new_empty(shape, dtype=dtype)
        if _settings.POISON_OUTPUTS:  # NCD_POISON_OUTPUTS / ncd.settings.poisoned() (an attribute: no frame)
            out.fill_(float("nan"))
        return out

    def _buffers(self, like: torch.Tensor, index: int, stream: int, n_ws: int, n_cnt: int) -> tuple:
        key = (index, stream)
        bufs = self.buffers.get(key)
        if bufs is None or bufs[0].numel() < n_ws or bufs[1].numel() < n_cnt:
            old = bufs or (like.new_empty((0,)), like.new_empty((0,)))
            bufs = (like.new_empty((max(n_ws, old[0].numel(), 1),), dtype=torch.float32),
                    torch.zeros((max(n_cnt, old[1].numel(), 1),), device=like.device, dtype=torch.int32))
            self.buffers[key] = bufs
        if _settings.POISON_OUTPUTS:  # NCD_POISON_OUTPUTS / ncd.settings.poisoned() (an attribute: no frame)
            bufs[0].fill_(float("nan"))
        return bufs

    def _plan(self, B: int, I: int, O: int, index: int, aligned: bool, like: torch.Tensor) -> _Plan:  # noqa: E741
        key = (B, I, O, index, aligned)
        plan = self.plans.get(key)
        if plan is None:
            plan = self.plans[key] = _Plan(self, B, I, O, index, like)
        return plan

    def _basis_fused(self, plan: _Plan, x: torch.Tensor, index: int, stream: int, need_d: bool) -> tuple:
        """LUT mode, fused regime: Phi [B, D, I] and (need_d) dPhi = P' du/dx, once per element."""
        B, I = x.shape  # noqa: E741
        tab, dtab = self._tables(x, index)
        phi = self._empty((B, self.config.degrees * I), x)
        dphi = self._empty((B, self.config.degrees * I), x) if need_d else None
        plan.basis(0, True, False, need_d)(stream, x, tab, dtab, phi, phi, phi, phi, dphi if need_d else phi, B, I)
        return phi, dphi

    def _basis_gemm(self, plan: _Plan, x: torch.Tensor, index: int, stream: int, write_p: bool, write_t: bool,
                    write_d: bool) -> tuple:
        """GEMM regime: Phi parts [B, D*I] (forward), transposed parts [D*I, B] (dC) and dPhi [B, D*I] (dX)."""
        B, I = x.shape  # noqa: E741
        K = self.config.degrees * I
        tab, dtab = self._tables(x, index)
        if tab is None:
            tab = dtab = x
        dt = plan.part_dtype
        ph, pl = (self._empty((B, K), x, dt), self._empty((B, K), x, dt)) if write_p else (x, x)
        pth, ptl = (self._empty((K, B), x, dt), self._empty((K, B), x, dt)) if write_t else (x, x)
        dp = self._empty((B, K), x) if write_d else x
        plan.basis(2 if plan.bf16 else 1, write_p, write_t, write_d)(stream, x, tab, dtab, ph, pl, pth, ptl, dp, B, I)
        return ph, pl, pth, ptl, dp

    def _split_parts(self, plan: _Plan, src: torch.Tensor, rows: int, cols: int, stream: int, write_n: bool,
                     write_t: bool) -> tuple:
        dt = plan.part_dtype
        hi, lo = (self._empty((rows, cols), src, dt), self._empty((rows, cols), src, dt)) if write_n else (src, src)
        thi, tlo = (self._empty((cols, rows), src, dt), self._empty((cols, rows), src, dt)) if write_t else (src, src)
        plan.split(rows, cols, write_n, write_t)(stream, src, hi, lo, thi, tlo, rows, cols)
        return hi, lo, thi, tlo

    def forward_impl(self, x: torch.Tensor, c: torch.Tensor, O: int, need_dx: bool = False,  # noqa: E741
                     need_dc: bool = False) -> tuple:
        """y [B, O] fp32 and what the backward needs. x [B, I] fp32 contiguous; c: the coefficients, any tensor
        whose storage is the kernel layout [D, I, O] contiguous (its data pointer is what the kernels read)."""
        B, I = x.shape  # noqa: E741
        if B == 0 or I == 0 or O == 0:
            return x.new_zeros((B, O)), None
        index = x.get_device()
        key = (B, I, O, index, ((x.data_ptr() | c.data_ptr()) & 15) == 0)
        plan = self.plans.get(key)
        if plan is None:
            plan = self._plan(*key, x)
        stream = 0 if _INTERPRET else torch._C._cuda_getCurrentRawStream(index)
        y = self._empty((B, O), x)
        degrees = self.config.degrees
        if plan.fused:
            ws, cnt = self._buffers(x, index, stream, plan.fwd_ws, plan.fwd_cnt)
            if self.config.basis_eval != "lut":
                plan.fwd(False)(stream, x, c, x, x, x, x, y, ws, cnt, cnt, *plan.fwd_args, 0)
                return y, None
            # the table is evaluated inside the forward kernel, once per element, into Phi (and dPhi for dX)
            tab, dtab = self._tables(x, index)
            phi = self._empty((B, degrees * I), x)
            dphi = self._empty((B, degrees * I), x) if need_dx else None
            plan.epoch += 1
            if plan.epoch * plan.til.fwd_tiles_n >= 2**30:  # group counters restart (stream-ordered memset)
                plan.flags.zero_()
                plan.epoch = 1
            plan.fwd(need_dx)(stream, x, c, phi, dphi if need_dx else phi, tab, dtab, y, ws, cnt, plan.flags,
                              *plan.fwd_args, plan.epoch)
            return y, (phi, dphi)
        K = degrees * I
        ch, cl, cth, ctl = self._split_parts(plan, c, K, O, stream, need_dx, True)
        ph, pl, pth, ptl, dp = self._basis_gemm(plan, x, index, stream, True, need_dc, need_dx)
        plan.gemm_fwd(stream, ph, pl, cth, ctl, y, B, O, K)
        return y, (ch, cl, pth, ptl, dp)

    def backward_impl(self, dy: torch.Tensor, x: torch.Tensor, c: torch.Tensor, O: int,  # noqa: E741
                      need_dx: bool = True, need_dc: bool = True, saved: Any = None) -> tuple:
        """(dx [B, I] or None, dc [D, I, O] or None) fp32; `saved` is what forward_impl returned (None:
        recompute)."""
        B, I = x.shape  # noqa: E741
        degrees = self.config.degrees
        if dy.dtype != torch.float32 or not dy.is_contiguous():
            dy = dy.to(torch.float32).contiguous()
        if B == 0 or I == 0 or O == 0:
            return (x.new_zeros((B, I)) if need_dx else None), (x.new_zeros((degrees, I, O)) if need_dc else None)
        index = x.get_device()
        key = (B, I, O, index, ((x.data_ptr() | c.data_ptr() | dy.data_ptr()) & 15) == 0)
        plan = self.plans.get(key)
        if plan is None:
            plan = self._plan(*key, x)
        stream = 0 if _INTERPRET else torch._C._cuda_getCurrentRawStream(index)
        dx = self._empty((B, I), x) if need_dx else None
        dc = self._empty((degrees, I, O), x) if need_dc else None
        if plan.fused:
            phi = dphi = x
            if self.config.basis_eval == "lut":
                phi, dphi = saved if saved is not None and (saved[1] is not None or not need_dx) else (
                    self._basis_fused(plan, x, index, stream, need_dx))
                dphi = dphi if dphi is not None else phi
            ws, cnt = self._buffers(x, index, stream, plan.wsx + plan.wsc, plan.bwd_cnt)
            plan.bwd(need_dx, need_dc)(stream, x, c, phi, dphi, dy, dx if need_dx else x, dc if need_dc else x, ws,
                                       cnt, *plan.bwd_args)
            return dx, dc
        K = degrees * I
        if saved is None:
            ch, cl, _, _ = self._split_parts(plan, c, K, O, stream, True, False) if need_dx else (x, x, x, x)
            _, _, pth, ptl, dp = self._basis_gemm(plan, x, index, stream, False, need_dc, need_dx)
        else:
            ch, cl, pth, ptl, dp = saved
        dyh, dyl, dyth, dytl = self._split_parts(plan, dy, B, O, stream, need_dx, need_dc)
        if need_dx:
            plan.dx(stream, dyh, dyl, ch, cl, dp, dx, B, I, O)
        if need_dc:
            plan.gemm_dc(stream, pth, ptl, dyth, dytl, dc, K, O, B)
        return dx, dc
