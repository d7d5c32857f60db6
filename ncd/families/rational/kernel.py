"""Static kernels of the group-rational family (KAT / FlashKAT): forward, FlashKAT-class backward, fixed-order reduce.

What a spec decides enters as `tl.constexpr` arguments: the generated module's `@triton.jit` hooks (the coefficient
loads with their coefficient-only prologue, the per-element forward, the per-element backward with its
accumulators, the per-program totals) and numbers (the coefficient counts). Per-program values travel between the
hooks and the kernels as tuples: Triton flattens them, so the compiled kernel is the one a fully spelled-out
kernel gives. Each op binds the kernels to its own autotuners (`RationalKernels`), so two ops never share tuning
entries; Triton's compile cache keys every hook by its source.

Launch layout: x [R, D] with unit channel stride, D = groups * W; grid (row programs, groups).
forward: y = F(x) in x's dtype. backward: dx and dc float32 [groups * K_GROUP + K_SHARED] (the per-group
coefficient gradients, group-major, then the shared ones); deterministic=False: one atomic add per coefficient
per program; True: per-program partials reduced in a fixed order by `rational_reduce` (bitwise reproducible for a
given autotuned config). Compute is fp32 whatever the storage dtype.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from ncd.launch import fast, sm_count
from ncd.tuning import autotune

from .config import RationalConfig

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# 1 / u on the GPU by one rcp.approx.ftz.f32 (relative error below 2^-23; flushes subnormal u), instead of the
# IEEE division's several instructions; the interpreter divides.
_FAST_RCP = tl.constexpr(not _INTERPRET)
_MIN_BLOCK_R = 16


@dataclass(frozen=True)
class RationalHooks:
    """The generated module's device functions (see the module docstring of a generated rational op)."""

    fwd_constants: Any  # (params, strides, g) -> tuple of per-program values (coefficients, prologue)
    fwd_element: Any  # (x, constants) -> y
    bwd_constants: Any  # (params, strides, g) -> tuple of per-program values
    bwd_zeros: Any  # (BLOCK_R, BLOCK_W) -> tuple of zeroed accumulators, one per live coefficient
    bwd_element: Any  # (x, dy, constants, accumulators, dx pointers, mask) -> accumulators, after storing dx
    bwd_total: Any  # (constants, accumulators, J) -> the program's total of gradient J (0.0 where not live)


@triton.jit
def rcp(u):
    if _FAST_RCP:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [u], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        return 1.0 / u


def _fwd_configs(config: RationalConfig) -> list:
    if _INTERPRET:  # one small config: the CPU interpreter is slow and autotuning is pointless there
        return [triton.Config({"BLOCK_R": 16, "BLOCK_W": 16}, num_warps=1)]
    return [triton.Config({"BLOCK_R": r, "BLOCK_W": w}, num_warps=nw) for r, w, nw in config.fwd_tiles]


def _bwd_configs(config: RationalConfig) -> list:
    if _INTERPRET:
        return [triton.Config({"BLOCK_R": 16, "BLOCK_W": 16}, num_warps=1)]
    return [triton.Config({"BLOCK_R": r, "BLOCK_W": w}, num_warps=config.bwd_warps, maxnreg=config.bwd_registers)
            for r, w in config.bwd_tiles]


def _padding(block_w: int, width: int) -> float:
    """Fraction of computed lanes that lie past the group's width."""
    return triton.cdiv(width, block_w) * block_w / width - 1


def _prune(configs: list, named_args: dict, **kwargs: Any) -> list:
    """Drop tiles wider than the group (beyond the next power of two): they would only compute padding."""
    width = kwargs["W"] if "W" in kwargs else named_args["W"]
    limit = max(16, triton.next_power_of_2(int(width)))
    kept = [c for c in configs if c.kwargs["BLOCK_W"] <= limit]
    return kept or configs[:1]


def _prune_bwd(configs: list, named_args: dict, **kwargs: Any) -> list:
    """The backward is bound by arithmetic as much as by memory: when some tile width wastes at most 1/8 of its
    lanes on padding (32 for a width of 96), keep only those. (The forward keeps its wide padded tiles: there
    they measured faster, 0.343 ms against 0.365 ms with 32-wide tiles only, H200, 2026-11-21.)"""
    kept = _prune(configs, named_args, **kwargs)
    width = int(kwargs["W"] if "W" in kwargs else named_args["W"])
    tight = [c for c in kept if _padding(c.kwargs["BLOCK_W"], width) <= 0.125]
    return tight or kept


_TUNE_KEY = ["W"]


@triton.jit
def rational_fwd(
    X, Y, PARAMS, R, stride_xr, stride_yr, STRIDES,
    W: tl.constexpr, CONSTANTS: tl.constexpr, ELEMENT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
):
    pid_r = tl.program_id(0)
    g = tl.program_id(1)
    k = CONSTANTS(PARAMS, STRIDES, g)  # this group's coefficients and what depends on them only, once per program
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    x_rows = X + rows.to(tl.int64)[:, None] * stride_xr + g * W
    y_rows = Y + rows.to(tl.int64)[:, None] * stride_yr + g * W
    for w0 in range(0, W, BLOCK_W):
        cols = w0 + tl.arange(0, BLOCK_W)
        m = row_ok[:, None] & (cols < W)[None, :]
        x = tl.load(x_rows + cols[None, :], mask=m, other=0.0).to(tl.float32)
        y = ELEMENT(x, k)
        tl.store(y_rows + cols[None, :], y.to(Y.dtype.element_ty), mask=m)


@triton.jit
def rational_bwd(
    X, DY, DX, DC, PARAMS, R, G, stride_xr, stride_dyr, stride_dxr, STRIDES,
    W: tl.constexpr, ATOMIC: tl.constexpr, K: tl.constexpr, K_GROUP: tl.constexpr, LIVE: tl.constexpr,  # bit j: dc_j
    CONSTANTS: tl.constexpr, ZEROS: tl.constexpr, ELEMENT: tl.constexpr, TOTAL: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
):
    pid_r = tl.program_id(0)
    g = tl.program_id(1)
    n_prog_r = tl.num_programs(0)
    k = CONSTANTS(PARAMS, STRIDES, g)
    # fp32 accumulators over this program's tiles (FlashKAT Algorithm 2, lines 8-13), reduced once at the end
    acc = ZEROS(BLOCK_R, BLOCK_W)
    # this program's tiles: t = pid_r, pid_r + n_prog_r, ... over (row block t // NW, width chunk t % NW); the
    # next tile's x and dy are loaded before the current one is computed (a register double buffer)
    NW: tl.constexpr = (W + BLOCK_W - 1) // BLOCK_W
    n_tiles = tl.cdiv(R, BLOCK_R) * NW
    offs_r = tl.arange(0, BLOCK_R)
    offs_w = tl.arange(0, BLOCK_W)
    rows = (pid_r // NW) * BLOCK_R + offs_r
    cols = (pid_r % NW) * BLOCK_W + offs_w
    m = (rows < R)[:, None] & (cols < W)[None, :]  # rows >= R past the last tile: the prefetch is masked off
    rows64 = rows.to(tl.int64)[:, None]
    x_next = tl.load(X + rows64 * stride_xr + (g * W + cols)[None, :], mask=m, other=0.0)
    dy_next = tl.load(DY + rows64 * stride_dyr + (g * W + cols)[None, :], mask=m, other=0.0)
    for t in range(pid_r, n_tiles, n_prog_r):
        x = x_next.to(tl.float32)
        dy = dy_next.to(tl.float32)
        out = DX + rows64 * stride_dxr + (g * W + cols)[None, :]
        m_out = m
        tn = t + n_prog_r
        rows = (tn // NW) * BLOCK_R + offs_r
        cols = (tn % NW) * BLOCK_W + offs_w
        m = (rows < R)[:, None] & (cols < W)[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        x_next = tl.load(X + rows64 * stride_xr + (g * W + cols)[None, :], mask=m, other=0.0)
        dy_next = tl.load(DY + rows64 * stride_dyr + (g * W + cols)[None, :], mask=m, other=0.0)
        acc = ELEMENT(x, dy, k, acc, out, m_out)  # stores dx, then adds to the accumulators
    if ATOMIC:  # one atomic per live coefficient per program
        for j in tl.static_range(K):
            if (LIVE >> j) & 1:
                if j < K_GROUP:
                    tl.atomic_add(DC + g * K_GROUP + j, TOTAL(k, acc, j), sem="relaxed")
                else:
                    tl.atomic_add(DC + G * K_GROUP + (j - K_GROUP), TOTAL(k, acc, j), sem="relaxed")
    else:  # this program's partials (0.0 for an identically zero gradient)
        base = (pid_r * G + g) * K
        for j in tl.static_range(K):
            tl.store(DC + base + j, TOTAL(k, acc, j))


@triton.jit
def rational_reduce(PART, OUT, P, G, K: tl.constexpr, K_GROUP: tl.constexpr, GROUP_SPAN: tl.constexpr,
                    BLOCK_P: tl.constexpr, BLOCK_G: tl.constexpr):
    """OUT[j] = sum of the partials [P, G, K] for output slot j, in a fixed order (deterministic mode)."""
    j = tl.program_id(0)
    shared = j >= G * K_GROUP
    g_lo = tl.where(shared, 0, j // GROUP_SPAN)
    g_n = tl.where(shared, G, 1)
    k = tl.where(shared, K_GROUP + j - G * K_GROUP, j % GROUP_SPAN)
    offs_p = tl.arange(0, BLOCK_P)
    offs_g = tl.arange(0, BLOCK_G)
    acc = tl.zeros([BLOCK_P, BLOCK_G], dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        pp = p0 + offs_p
        m = (pp < P)[:, None] & (offs_g < g_n)[None, :]
        acc += tl.load(PART + (pp[:, None] * G + g_lo + offs_g[None, :]) * K + k, mask=m, other=0.0)
    tl.store(OUT + j, tl.sum(tl.sum(acc, axis=1), axis=0))


def _num_sms(device: torch.device) -> int:
    return 1 if _INTERPRET else sm_count(device, 1)


def _strides(params: tuple) -> tuple:
    return tuple([p.stride() for p in params])  # stride() is a tuple already; a list: no generator frames


class RationalKernels:
    """The static kernels bound to one op's hooks and config, with autotuners of its own (so that ops sharing
    these kernels never share tuning entries: the best tile depends on the formula's arithmetic)."""

    def __init__(self, config: RationalConfig, hooks: RationalHooks):
        self.config = config
        self.hooks = hooks
        self.fwd = autotune(name="rational", configs=_fwd_configs(config), key=_TUNE_KEY,
                                   prune_configs_by={"early_config_prune": _prune})(rational_fwd)
        # reset_to_zero: the autotuner runs each config several times; atomic accumulators must start at zero.
        self.bwd = autotune(name="rational", configs=_bwd_configs(config), key=_TUNE_KEY, reset_to_zero=["DC"],
                                   prune_configs_by={"early_config_prune": _prune_bwd})(rational_bwd)
        self.live = sum(1 << j for j, alive in enumerate(config.live) if alive)  # a bit mask: an int constexpr

    def forward(self, x: torch.Tensor, params: tuple, groups: int, poison: bool = False) -> torch.Tensor:
        """y = F(x) with x [R, groups * W] (unit channel stride); y in x's dtype."""
        rows, chans = x.shape
        width = chans // groups
        y = torch.empty_like(x, memory_format=torch.contiguous_format)
        if poison:
            y.fill_(float("nan"))
        if rows == 0 or width == 0:
            return y
        hooks = self.hooks
        grid = lambda meta: (triton.cdiv(rows, meta["BLOCK_R"]), groups)
        fast(self.fwd)[grid](x, y, tuple(params), rows, x.stride(0), y.stride(0), _strides(params), W=width,
                             CONSTANTS=hooks.fwd_constants, ELEMENT=hooks.fwd_element)
        return y

    def row_programs(self, rows: int, groups: int, device: torch.device) -> int:
        """The backward's row-program count (independent of the tile config, so partials have a fixed shape): one
        wave of `resident_per_sm` programs per SM (4 row programs under the interpreter)."""
        cap = 4 if _INTERPRET else max(1, self.config.resident_per_sm * _num_sms(device) // groups)
        return max(1, min(triton.cdiv(rows, _MIN_BLOCK_R), cap))

    def backward(self, dy: torch.Tensor, x: torch.Tensor, params: tuple, groups: int, deterministic: bool = False,
                 poison: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """dx (x's dtype) and dc (float32 [groups * k_group + k_shared]) from dy."""
        config, hooks = self.config, self.hooks
        rows, chans = x.shape
        width = chans // groups
        dx = torch.empty_like(x, memory_format=torch.contiguous_format)
        if poison:
            dx.fill_(float("nan"))
        n_out = groups * config.k_group + config.k_shared
        if rows == 0 or width == 0:
            return dx, torch.zeros(n_out, device=x.device, dtype=torch.float32)
        n_prog = self.row_programs(rows, groups, x.device)
        if deterministic:
            dc = torch.empty((n_prog, groups, config.k), device=x.device, dtype=torch.float32)
            if poison:
                dc.fill_(float("nan"))
        else:
            dc = torch.zeros(n_out, device=x.device, dtype=torch.float32)
        fast(self.bwd)[(n_prog, groups)](
            x, dy, dx, dc, tuple(params), rows, groups, x.stride(0), dy.stride(0), dx.stride(0), _strides(params),
            W=width, ATOMIC=not deterministic, K=config.k, K_GROUP=config.k_group, LIVE=self.live,
            CONSTANTS=hooks.bwd_constants, ZEROS=hooks.bwd_zeros, ELEMENT=hooks.bwd_element, TOTAL=hooks.bwd_total)
        if not deterministic:
            return dx, dc
        out = torch.empty(n_out, device=x.device, dtype=torch.float32)
        if poison:
            out.fill_(float("nan"))
        block_g = triton.next_power_of_2(groups) if config.k_shared else 1
        block_p = max(1, min(triton.next_power_of_2(n_prog), 2048 // block_g))
        fast(rational_reduce)[(n_out,)](dc, out, n_prog, groups, K=config.k, K_GROUP=config.k_group,
                                        GROUP_SPAN=max(config.k_group, 1), BLOCK_P=block_p, BLOCK_G=block_g)
        return dx, out
