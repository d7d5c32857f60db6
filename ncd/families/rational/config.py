"""What a rational plan decides for the kernels (kernel.py), as one frozen object, and the tile tables it draws
from. Free of torch and Triton, so that planning imports neither."""

from __future__ import annotations

from dataclasses import dataclass

BWD_WARPS = 4  # the backward's programs: 4 warps, about 4 elements per thread per tile
ACCUMULATE_MODES = ("atomic", "deterministic")
# (BLOCK_R, BLOCK_W, warps) of the forward's autotune configs
FWD_TILES = ((32, 32, 4), (64, 32, 4), (32, 64, 4), (64, 64, 8), (128, 32, 8), (16, 128, 4), (32, 128, 8))
# (BLOCK_R, BLOCK_W) of the backward's: 4 elements per thread, one 16-byte vector of x and of dy per thread and
# tile, K accumulators each (H200, K = 10, width 96, 2026-11-21: 16 x 32 under 72 registers 0.542 ms, uncapped
# (96) 0.636 ms)
BWD_TILES = ((16, 32), (8, 64), (4, 128))


def backward_registers(k: int) -> int:
    """The backward's register cap: K fp32 accumulators for each of a thread's 4 elements plus about 32 (x, dy,
    their prefetch, the coefficients). At K = 10 this is 72 (ptxas: 71, no spills; uncapped it takes 96)."""
    return max(64, min(255, -(-(4 * k + 32) // 8) * 8))


def backward_resident(k: int) -> int:
    """Backward programs resident per SM under the register cap (65536 registers, at most 16 programs). The
    grid is exactly this many programs per SM, each persistent over its share of the tiles: one wave, so no
    partly filled last wave, and every program issues its atomics once, after many tiles."""
    return max(1, min(16, 65536 // (backward_registers(k) * 32 * BWD_WARPS)))


@dataclass(frozen=True)
class RationalConfig:
    """What a rational plan decides for the kernels. `live[k]`: dF/dc_k is not identically zero (its
    accumulator exists and it takes an atomic); the coefficient order is per-group ones first, then shared."""

    k_group: int
    k_shared: int
    live: tuple[bool, ...]
    bwd_warps: int = BWD_WARPS
    bwd_registers: int = 64
    resident_per_sm: int = 1
    accumulate: str = "atomic"  # the default accumulation of the coefficient gradients
    fwd_tiles: tuple[tuple[int, int, int], ...] = FWD_TILES
    bwd_tiles: tuple[tuple[int, int], ...] = BWD_TILES

    def __post_init__(self) -> None:
        if self.accumulate not in ACCUMULATE_MODES:
            raise ValueError(f"accumulate must be one of {', '.join(ACCUMULATE_MODES)}, not {self.accumulate!r}")

    @property
    def k(self) -> int:
        return self.k_group + self.k_shared

    @classmethod
    def for_coefficients(cls, k_group: int, k_shared: int, live: tuple[bool, ...]) -> RationalConfig:
        k = k_group + k_shared
        return cls(k_group, k_shared, live, BWD_WARPS, backward_registers(k), backward_resident(k))

    def describe(self) -> list[str]:
        dead = [str(i) for i, alive in enumerate(self.live) if not alive]
        return [
            f"config: K = {self.k} coefficients ({self.k_group} per group, {self.k_shared} shared); "
            f"identically zero gradients: {', '.join(dead) or 'none'}",
            "  forward tiles (BLOCK_R, BLOCK_W, warps), autotuned on W: "
            + ", ".join(f"{r}x{w}/{nw}" for r, w, nw in self.fwd_tiles),
            f"  backward tiles (BLOCK_R, BLOCK_W), autotuned on W: {', '.join(f'{r}x{w}' for r, w in self.bwd_tiles)}"
            f"; {self.bwd_warps} warps under {self.bwd_registers} registers, {self.resident_per_sm} programs per SM",
            f"  default accumulation: {self.accumulate}",
        ]
