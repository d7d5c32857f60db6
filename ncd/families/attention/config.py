"""What the plan decides for one attention op (plan.py fills it; the generated module embeds its values as
literals). Free of torch and Triton, so that planning imports neither."""

from __future__ import annotations

from dataclasses import dataclass, replace

Tile = tuple[int, ...]  # (BLOCK_M, BLOCK_N, num_warps, num_stages[, HEADS_FAST])

# Tiles that measured best on an H100 (bench/attention.py --tiles, 2026-11-21; bf16, D = 128): the forward's
# plan-ranked set is extended with them, and autotuning picks per (sequence-length bucket, TMA).
MEASURED_FORWARD_TILES: tuple[Tile, ...] = ((64, 64, 4, 3), (128, 128, 8, 3), (128, 32, 4, 3))
DEFAULT_FORWARD_TILES: tuple[Tile, ...] = ((128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 8, 4), (64, 64, 4, 4),
                                           (128, 64, 8, 3, 1), (256, 64, 16, 3))
FACTORIZE_MODES = ("auto", "always", "never")
# Keys per causal chunk of the factorized form where the config leaves it None: the GPU's (factorize.py's CHUNK,
# measured) and the CPU interpreter's (small: the interpreter is slow)
GPU_CHUNK, INTERPRET_CHUNK = 128, 16


@dataclass(frozen=True)
class AttentionConfig:
    """The knobs the plan decides for one attention op: tiles, precisions, modes, the factorized form and the
    accumulation. Frozen: part of what the op is; the generated module starts its run-time switches from it."""

    # autotune sets per kernel; HEADS_FAST=1 launches batch * heads as the grid's fast (x) dimension
    forward_tiles: tuple[Tile, ...] = DEFAULT_FORWARD_TILES
    dkdv_tiles: tuple[Tile, ...] = ((64, 64, 4, 2), (32, 64, 4, 3), (64, 128, 8, 3), (32, 128, 8, 3),
                                    (32, 128, 8, 2), (64, 128, 8, 2, 1))
    dq_tiles: tuple[Tile, ...] = ((64, 32, 4, 4), (128, 64, 8, 3), (128, 64, 8, 2), (64, 64, 4, 3),
                                  (128, 64, 8, 3, 1))
    fused_tiles: tuple[Tile, ...] = ((64, 128, 8, 2), (64, 64, 8, 2), (64, 64, 8, 3), (32, 128, 8, 2))
    dq_ds_tiles: tuple[Tile, ...] = ((128, 64, 8, 3), (128, 64, 8, 4), (128, 64, 4, 4), (256, 64, 8, 3),
                                     (128, 128, 8, 3), (64, 64, 4, 4))
    # products of fp32 inputs ("ieee": exact fp32, matches a CPU fp32 reference); 16-bit inputs use `low_precision`
    fp32_precision: str = "ieee"
    low_precision: str = "tf32"
    # accumulation: fp32 accumulators; a running row max (softmax-like maps); exp2 with log2(e) folded into the
    # scale where a1 = a2 = a1' = a2' = exp and no pre-map or score modifier (the forward's: with them too,
    # kernel.py `forward_spec`); a1 == a2 evaluated once; the
    # backward's row statistics folded (m + log b(z), delta b(z)) where a1 = a2 = a1' = a2' = exp
    online_max: bool = False
    exp2: bool = False
    shared_map: bool = False
    fold: bool = False
    # backward: separate dK/dV and dQ kernels (bitwise reproducible) or one kernel with atomic dQ; the stored-dS
    # buffer limit; TMA bulk copies where the layout allows
    deterministic_bwd: bool = True
    ds_buffer_bytes: int = 4 << 30
    ds_bulk_store: bool = True
    use_tma: bool = True
    # factorized form (factorize.py): present or not, keys per causal chunk (None: GPU_CHUNK on the GPU,
    # INTERPRET_CHUNK in the CPU interpreter), the largest head-dim tile, and which form a call takes: "auto" (the
    # cost model's crossover, per call), "always" or "never" (NCD_ATTENTION_FACTORIZE fills it: `with_settings`)
    factorized: bool = False
    chunk: int | None = None
    fact_max_head_dim: int = 128
    factorize: str = "auto"
    # split-K decoding (kernel_decode.py): "auto" (short queries against many keys: kernel_decode.use_decode),
    # "always" or "never"
    decode: str = "auto"

    def __post_init__(self) -> None:
        if self.factorize not in FACTORIZE_MODES:
            raise ValueError(f"factorize must be one of {', '.join(FACTORIZE_MODES)}, not {self.factorize!r}")
        if self.decode not in FACTORIZE_MODES:
            raise ValueError(f"decode must be one of {', '.join(FACTORIZE_MODES)}, not {self.decode!r}")
        if self.chunk is not None and self.chunk not in (16, 32, 64, 128, 256):
            raise ValueError(f"chunk must be None (the platform's) or 16, 32, 64, 128 or 256 keys, not {self.chunk!r}")
        if self.ds_buffer_bytes < 0:
            raise ValueError(f"ds_buffer_bytes must be 0 or more, not {self.ds_buffer_bytes}")

    def with_settings(self) -> AttentionConfig:
        """The form choice and the dS buffer limit from NCD_ATTENTION_FACTORIZE and NCD_ATTENTION_DS_BUFFER_BYTES
        (read now; unset: this config's)."""
        from ncd.settings import settings

        current = settings()
        chosen = current.attention_ds_buffer_bytes
        return replace(self, factorize=current.attention_factorize,
                       ds_buffer_bytes=self.ds_buffer_bytes if chosen is None else chosen)

    def describe(self) -> list[str]:
        def tiles(ts: tuple[Tile, ...]) -> str:
            return " ".join("x".join(map(str, t)) for t in ts)

        lines = [
            "config:",
            "  autotune tiles (BLOCK_M x BLOCK_N x warps x stages[ x heads-fast]):",
            f"    forward    {tiles(self.forward_tiles)} (+ the measured {tiles(MEASURED_FORWARD_TILES)})",
            f"    dK/dV      {tiles(self.dkdv_tiles)}",
            f"    dQ         {tiles(self.dq_tiles)}",
            f"    dQ from dS {tiles(self.dq_ds_tiles)}",
            f"    fused      {tiles(self.fused_tiles)}",
            f"  products: fp32 inputs {self.fp32_precision}, 16-bit inputs {self.low_precision}; fp32 accumulation",
            f"  accumulation: running max {'on' if self.online_max else 'off'}, "
            f"{'exp2 (log2 e folded into the scale)' if self.exp2 else 'the maps as printed'}"
            f"{', a1 = a2 evaluated once' if self.shared_map else ''}"
            f"{'; backward statistics folded (m + log b(z), delta b(z))' if self.fold else ''}",
            f"  backward: {'deterministic (dK/dV and dQ kernels)' if self.deterministic_bwd else 'fused, atomic dQ'}; "
            f"stored dS up to {self.ds_buffer_bytes} bytes; TMA {'on' if self.use_tma else 'off'}, "
            f"dS bulk store {'on' if self.ds_bulk_store else 'off'}",
        ]
        if self.factorized:
            chunk = f"{self.chunk} keys" if self.chunk else f"{GPU_CHUNK} keys ({INTERPRET_CHUNK} interpreted)"
            lines.append(f"  factorized form: chunks of {chunk}, head-dim tiles up to {self.fact_max_head_dim}; "
                         f"form per call: {self.factorize}")
        return lines
