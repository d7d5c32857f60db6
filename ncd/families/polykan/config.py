"""What a polynomial-KAN plan decides for the kernels (`PolyKANConfig`) and the per-size launch decisions
(`tiling`, read by the planner for `--emit plan` and by the generated modules at run time, so generated code never
imports the planner). Free of torch and Triton, so that planning imports neither."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PolyKANConfig:
    """What a polynomial-KAN plan decides for the kernels (the per-size tiling is `tiling`'s, at run time)."""

    degrees: int
    basis_eval: str  # "lut" or "recurrence"
    matmul: str  # the family option: "tf32x3" or "bf16x3"
    matmul_split: str  # the GEMM regime's operand parts: "tf32" or "bf16"
    layout: tuple[str, str, str]  # the kernels' coefficient layout (axis names)
    perm: tuple[int, int, int]  # spec layout -> kernel layout
    lut_entries: int | None = None  # lookup-table entries (LUT mode)
    lut_const: int = 0  # leading constant basis terms the table reads exactly
    # Launch choices `tiling` makes per size, fixed here instead (tests, the benchmark's sweeps). None: the
    # per-size choice, or the platform's default (ncd/families/polykan/kernel.py: LAUNCH_DEFAULTS).
    regime: str | None = None  # "fused" or "gemm" at every size
    gemm_tiles: tuple[int, int, int, int, int] | None = None  # the gemm regime's (BM, BN, BK, warps, stages); GPU
    fused_tiles: tuple[int, int, int, int, int, int] | None = None  # see `tiling`'s `fused`; GPU
    fused_precision: str | None = None  # the fused kernels' tl.dot input precision (tf32x3; ieee interpreted)
    gemm_kchunk: int | None = None  # K between adds of the tensor-core accumulator into fp32 (1024; 32 interpreted)
    lut_wait_spins: int | None = None  # LUT forward: counter reads before a program evaluates every degree itself
    lut_fallback: bool = True  # False: no program evaluates degrees past its share (tests: the shares cover all)

    def __post_init__(self) -> None:
        if self.regime not in (None, "fused", "gemm"):
            raise ValueError(f"regime must be None, 'fused' or 'gemm', not {self.regime!r}")

    def describe(self) -> list[str]:
        lines = [f"config: {self.degrees} degrees; basis_eval {self.basis_eval}"
                 + (f" ({self.lut_entries} table entries, {self.lut_const} constant terms)"
                    if self.lut_entries is not None else ""),
                 f"  coefficient layout [{' '.join(self.layout)}] (permute{self.perm}); matmul {self.matmul} "
                 f"(GEMM regime operand parts: {self.matmul_split})"]
        fixed = [f"{name} {getattr(self, name)}" for name in LAUNCH_FIELDS if getattr(self, name) is not None]
        if not self.lut_fallback:
            fixed.append("lut_fallback False")
        if fixed:
            lines.append(f"  launch choices fixed by the config (not per size): {', '.join(fixed)}")
        return lines


# the config's launch choices that default to None (the per-size or the platform's choice)
LAUNCH_FIELDS = ("regime", "gemm_tiles", "fused_tiles", "fused_precision", "gemm_kchunk", "lut_wait_spins")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# The fused regime's backward reduces the batch in chunks of at most 64 rows; more chunks than this, or dC
# partials (one [deg, inp, outp] slab per chunk) larger than this many elements, select the GEMM regime.
FUSED_MAX_CHUNKS = 8
FUSED_MAX_PARTIALS = 1 << 24
# GEMM regime, per operand split: (BM, BN, BK, warps, stages). tf32 parts are fp32 words (BK 32: 64 KiB of
# operands per stage); bf16 parts are half the bytes, so BK doubles for the same shared memory.
GEMM_CONFIGS = {"tf32": (128, 128, 32, 8, 3), "bf16": (128, 128, 64, 8, 3)}
MATMUL = {"tf32x3": "tf32", "bf16x3": "bf16"}  # family option -> operand split of the GEMM regime


@dataclass(frozen=True)
class Tiling:
    """Launch decisions for one problem size.

    regime "fused" (launch-bound sizes): one forward kernel (output tiles x split of inp, last-arriving
    program per tile combines the partials in fixed order) and one backward kernel computing dX and dC
    together per (inp tile, outp tile, batch chunk): dX partials per outp tile and dC partials per batch
    chunk are combined the same way. regime "gemm" (large sizes): the basis materialised once per element
    as split operands, then tensor-core GEMMs with K-major operands."""

    regime: str
    # fused forward: blocks (BM, BN, BI), split of inp, inp elements per split, output tiles (m x n), n tiles
    fwd_blocks: tuple[int, int, int] = (0, 0, 0)
    fwd_split: int = 1
    fwd_per_split: int = 0
    fwd_tiles: int = 0
    fwd_tiles_n: int = 0
    # fused backward: blocks (BM, BI, BO), batch chunks, (inp x outp) tiles, outp tiles
    bwd_blocks: tuple[int, int, int] = (0, 0, 0)
    bwd_chunks: int = 1
    bwd_tiles: int = 0
    bwd_tiles_o: int = 0
    warps: int = 4
    stages: int = 3
    # gemm regime: (BM, BN, BK, warps, stages) and the basis kernel's blocks (batch, inp)
    gemm: tuple[int, int, int, int, int] = (0, 0, 0, 0, 0)
    basis_blocks: tuple[int, int] = (32, 32)

    def launches(self, basis_eval: str) -> tuple[int, int]:
        """Kernel launches of (forward with grad, backward) in eager mode."""
        if self.regime == "fused":
            return 1, 1
        return 3, 3

    def describe(self, r: Any, basis_eval: str) -> list[str]:
        if self.regime == "fused":
            bm, bn, bi = self.fwd_blocks
            fwd = (f"  forward  (x, C -> {r.output}): {self.fwd_tiles} output tiles [{bm} x {bn}] x split-{r.inp} "
                   f"{self.fwd_split} ({self.fwd_per_split} {r.inp} per split, blocks of {bi}) = "
                   f"{self.fwd_tiles * self.fwd_split} programs" + (
                       "; partials combined in fixed order by the last-arriving program of each tile (atomic "
                       "counter per tile, reset by that program): one launch" if self.fwd_split > 1 else ""))
            bb, bi2, bo = self.bwd_blocks
            bwd = (f"  backward (dy, x, C -> d{r.x}, d{r.coeffs}): one kernel, {self.bwd_tiles} ({r.inp} x {r.outp}) "
                   f"tiles [{bi2} x {bo}] x {self.bwd_chunks} {r.batch} chunk(s) of {bb} = "
                   f"{self.bwd_tiles * self.bwd_chunks} programs; dX partials per {r.outp} tile "
                   f"({self.bwd_tiles_o}) and dC partials per {r.batch} chunk combined by the last-arriving "
                   "program (two-stage, fixed order, no per-element atomics)")
            pre = ("  basis (LUT): evaluated inside the forward kernel, once per element: the programs of a (batch "
                   "tile, split) group each write a share of the degrees of P_d and P'_d du/dx into [batch deg inp] "
                   "and wait for the group (arrival counter; a member that waits too long evaluates the slice "
                   "itself); saved for the backward" if basis_eval == "lut" else
                   "  basis (recurrence): evaluated inside the contraction kernels, in registers")
            return [pre, fwd, bwd]
        bm, bn, bk, w, s = self.gemm
        return [
            f"  basis: one kernel evaluates P_d (and P'_d du/dx) once per element, written as split operands "
            f"[{r.batch}, {r.deg}*{r.inp}] (and transposed for dC)",
            f"  forward: coefficients transposed and split once per call, then y = Phi . C^T as one GEMM; "
            f"blocks {bm}x{bn}x{bk}, {w} warps, {s} stages; the tensor-core accumulator is added into an fp32 "
            "sum every 1024 of K (the config's gemm_kchunk)",
            f"  backward: dX = sum_d P'_d du/dx (dy . C_d^T) with the degree sum in the GEMM epilogue; "
            f"dC = Phi^T . dy as one GEMM (the {r.batch} reduction is the GEMM's K loop: no partials)",
        ]


def tiling(batch: int, inp: int, outp: int, degrees: int, sms: int, interpret: bool = False,
           split: str = "tf32", regime: str | None = None,
           fused: tuple[int, int, int, int, int, int] | None = None) -> Tiling:
    """The regime and its tiles: the largest tiles giving at least 1.5 programs per SM, the input axis split
    towards two per SM; one small config under the CPU interpreter. `regime` forces "fused" or "gemm" (tests);
    `fused` = (forward BN, forward BI, backward BI, backward BO, warps, stages) overrides the fused choice."""
    target = 2 * sms
    enough = sms + sms // 2
    chunk = 16 if interpret else min(64, max(16, _pow2(batch)))
    chunks = _cdiv(batch, chunk)
    if regime is None:
        regime = "fused" if chunks <= FUSED_MAX_CHUNKS and (
            chunks == 1 or chunks * degrees * inp * outp <= FUSED_MAX_PARTIALS) else "gemm"
    if regime == "gemm":
        gemm = (16, 16, 16, 1, 1) if interpret else GEMM_CONFIGS[split]
        return Tiling("gemm", gemm=gemm, basis_blocks=(16, 16) if interpret else (32, 32))
    if interpret:
        fb, bb = (16, 16, 16), (16, 16, 16)
        warps, stages = 1, 1
    else:
        bm = min(64, max(16, _pow2(batch)))
        fb = (bm, 16, 16)
        for bn, bi in ((64, 32), (64, 16), (32, 16)):
            fb = (bm, bn, bi)
            if _cdiv(batch, bm) * _cdiv(outp, bn) * _cdiv(inp, bi) >= enough:
                break
        bb = (chunk, 16, 16)
        for bi, bo in ((32, 64), (32, 32), (16, 32), (16, 16)):
            bb = (chunk, bi, bo)
            if _cdiv(inp, bi) * _cdiv(outp, bo) * chunks >= enough:
                break
        warps, stages = 4, 3
        if fused is not None:
            fb, bb = (bm, fused[0], fused[1]), (chunk, fused[2], fused[3])
            warps, stages = fused[4], fused[5]
    tiles_n = _cdiv(outp, fb[1])
    tiles = _cdiv(batch, fb[0]) * tiles_n
    blocks = _cdiv(inp, fb[2])
    want = max(1, min(blocks, _cdiv(target, tiles)))
    per = _cdiv(blocks, want)
    return Tiling("fused", fb, _cdiv(blocks, per), per * fb[2], tiles, tiles_n, bb, chunks,
                  _cdiv(inp, bb[1]) * _cdiv(outp, bb[2]), _cdiv(outp, bb[2]), warps, stages)
