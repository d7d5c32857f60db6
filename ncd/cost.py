"""Tiling choices and their cost, in the spirit of FlashAttention on a Napkin (Abbott and Zardini, 2024).

For a streamed attention kernel the query axis is group-partitioned into tiles of `block_m` rows (each tile
re-reads K and V, which are not woven over queries) and the key axis is stream-partitioned into blocks of
`block_n` (only the accumulator stays live). Per memory level we count the bytes that cross into it and the
peak live footprint, plus FLOPs, and bound the time by the H100 roofline. The estimate ranks tile configs;
`triton.autotune` then measures the few that survive pruning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# H100 SXM leads (shared anchors): measured dense bf16 and copy bandwidth, SMEM per SM, registers per SM.
H100 = {"flops": 800e12, "flops_fp32": 400e12, "hbm": 3.0e12, "l2_bw": 10e12, "l2": 50e6, "smem": 228 * 1024,
        "regs": 65536, "sms": 132}


def kernel_head_dim(head_dim: int) -> int:
    """The head-dim tile the attention kernels run at: a power of two, at least 16 (tl.arange and the
    tensor-core tiles need both). The kernels mask the columns past the head dim (`head_tile` in the generated
    module computes the same); costs are estimated at the tile."""
    return max(16, 1 << (head_dim - 1).bit_length())


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class AttentionShape:
    batch_heads: int  # B * H (query heads)
    kv_heads_ratio: int  # query heads per K/V head
    n_query: int
    n_key: int
    head_dim: int
    value_dim: int
    elem_bytes: int
    causal: bool


@dataclass(frozen=True)
class LevelCost:
    level: str
    bytes_in: float  # bytes that cross into this level over the whole kernel
    live_bytes: float  # peak live footprint per program (registers, SMEM) or total (GMEM)
    capacity: float


@dataclass(frozen=True)
class Estimate:
    config: TileConfig
    flops: float
    levels: tuple[LevelCost, ...]
    seconds: float
    bound: str  # compute | memory

    @property
    def fits(self) -> bool:
        return all(level.live_bytes <= level.capacity for level in self.levels)


def forward_estimate(shape: AttentionShape, config: TileConfig, dense_flops: float = H100["flops"]) -> Estimate:
    s, c = shape, config
    visible = 0.5 if s.causal else 1.0
    flops = 2.0 * s.batch_heads * s.n_query * s.n_key * (s.head_dim + s.value_dim) * visible
    q_tiles = math.ceil(s.n_query / c.block_m)
    q_bytes = s.batch_heads * s.n_query * s.head_dim * s.elem_bytes
    kv_bytes = s.batch_heads // s.kv_heads_ratio * s.n_key * (s.head_dim + s.value_dim) * s.elem_bytes
    o_bytes = s.batch_heads * s.n_query * (s.value_dim * s.elem_bytes + 8)  # output + two row statistics
    # every query tile streams all visible keys and values into SMEM (group partition over queries re-sends
    # them); with the head-major grid the tiles of a head run together, so repeats come from L2, not HBM
    to_smem = q_bytes + s.batch_heads * q_tiles * s.n_key * (s.head_dim + s.value_dim) * s.elem_bytes * visible
    heads_live = math.ceil(H100["sms"] / q_tiles)  # query tiles of one head are adjacent in the grid
    head_set = kv_bytes / max(1, s.batch_heads // s.kv_heads_ratio) * heads_live
    hbm = q_bytes + o_bytes + (kv_bytes if head_set <= H100["l2"] else to_smem - q_bytes)
    smem_live = (c.block_m * s.head_dim + c.num_stages * c.block_n * (s.head_dim + s.value_dim)) * s.elem_bytes
    # registers: the fp32 accumulator, the fp32 score tile and its low-precision copy for the second dot
    reg_live = c.block_m * s.value_dim * 4 + c.block_m * c.block_n * (4 + s.elem_bytes) + c.block_m * 12
    # a program gets at most 255 registers per thread; leave a quarter for addresses and temporaries
    reg_capacity = min(H100["regs"], 255 * 32 * c.num_warps) * 4 * 0.75
    levels = (
        LevelCost("HBM", hbm, q_bytes + kv_bytes + o_bytes, float("inf")),
        LevelCost("L2->SMEM", to_smem, smem_live, H100["smem"]),
        LevelCost("registers", to_smem, reg_live, reg_capacity),
    )
    rate = dense_flops if s.elem_bytes == 2 else H100["flops_fp32"]
    compute, memory = flops / rate, max(hbm / H100["hbm"], to_smem / H100["l2_bw"])
    waves = math.ceil(s.batch_heads * q_tiles / H100["sms"]) / max(1e-9, s.batch_heads * q_tiles / H100["sms"])
    return Estimate(c, flops, levels, max(compute, memory) * waves, "compute" if compute >= memory else "memory")


CANDIDATES = tuple(
    TileConfig(m, n, w, st)
    for m in (64, 128)
    for n in (32, 64, 128)
    for w in (4, 8)
    for st in (2, 3, 4)
)


def rank_configs(shape: AttentionShape, keep: int = 6) -> list[Estimate]:
    """Candidate tiles that fit SMEM and registers, best estimated first (ties: fewer GMEM bytes)."""
    estimates = [forward_estimate(shape, c) for c in CANDIDATES]
    fitting = [e for e in estimates if e.fits]
    # ties (compute-bound tiles) go to fewer L2 re-reads, then longer key blocks (fewer loop trips)
    fitting.sort(key=lambda e: (round(e.seconds, 6), e.levels[1].bytes_in, -e.config.block_n,
                                e.levels[1].live_bytes))
    return fitting[:keep]


def format_estimate(e: Estimate) -> list[str]:
    c = e.config
    lines = [f"tile block_m={c.block_m} block_n={c.block_n} warps={c.num_warps} stages={c.num_stages}: "
             f"{e.flops / 1e9:.1f} GFLOP, roofline {e.seconds * 1e3:.3f} ms ({e.bound}-bound on H100)"]
    for level in e.levels:
        cap = "" if math.isinf(level.capacity) else f" of {level.capacity / 1024:.0f} KiB"
        unbounded = math.isinf(level.capacity)
        live = f"{level.live_bytes / 1e6:.1f} MB" if unbounded else f"{level.live_bytes / 1024:.1f} KiB"
        lines.append(f"    {level.level:<9} in {level.bytes_in / 1e6:9.1f} MB   live {live}{cap}")
    return lines


@dataclass(frozen=True)
class FormEstimate:
    """Forward cost of the factorized (chunked when causal) form: tensor-core FLOPs and HBM bytes."""

    flops: float
    hbm_bytes: float
    seconds: float
    bound: str


def factorized_estimate(shape: AttentionShape, chunk: int) -> FormEstimate:
    """The factorized form's forward (attention's factorize.py). A scan writes K_w^T [V | K] ([D, 2D] per kv head,
    one per chunk of `chunk` keys when causal); the output kernel reads Q, the states, and (causal) the keys
    and values of its own chunk, whose scores it forms as the streamed kernel does on its diagonal."""
    s = shape
    kv_heads = max(1, s.batch_heads // s.kv_heads_ratio)
    state = s.head_dim * (s.head_dim + s.value_dim)
    states = math.ceil(s.n_query / chunk) if s.causal else 1
    # scan: K^T [V | K] over the visible keys; output: q [S | M] per query (+ the own chunk's scores)
    scanned = min(s.n_key, s.n_query) if s.causal else s.n_key
    flops = 2.0 * kv_heads * scanned * state + 2.0 * s.batch_heads * s.n_query * state
    if s.causal:
        flops += 2.0 * s.batch_heads * s.n_query * chunk * (s.head_dim + s.value_dim) * 0.5
    elem = s.elem_bytes
    hbm = (s.batch_heads * s.n_query * (s.head_dim + s.value_dim) * elem + s.batch_heads * s.n_query * 4
           + kv_heads * s.n_key * (s.head_dim + s.value_dim) * elem * (2 if s.causal else 1)
           + kv_heads * states * state * elem * (1 + s.kv_heads_ratio))
    rate = H100["flops"] if elem == 2 else H100["flops_fp32"]
    compute, memory = flops / rate, hbm / H100["hbm"]
    return FormEstimate(flops, hbm, max(compute, memory), "compute" if compute >= memory else "memory")


def format_forms(streamed: Estimate, factorized: FormEstimate, chosen: bool, rule: str) -> list[str]:
    return [
        "forms (forward roofline on H100):",
        f"  streamed   {streamed.flops / 1e9:9.1f} GFLOP  {streamed.seconds * 1e3:.3f} ms ({streamed.bound}-bound)",
        f"  factorized {factorized.flops / 1e9:9.1f} GFLOP  {factorized.hbm_bytes / 1e6:9.1f} MB HBM  "
        f"{factorized.seconds * 1e3:.3f} ms ({factorized.bound}-bound)",
        f"  chosen at these sizes: {'factorized' if chosen else 'streamed'} ({rule})",
    ]
