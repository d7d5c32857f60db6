"""What the recurrence family's plan decides for its kernels (kernel.py), as one frozen object.

The plan builds it (`RecurrencePlan.config`, printed by `--emit plan`); the generated module embeds its values as
literals (`CONFIG`) and passes it to every launch, so a test or a benchmark changes a precision or a tile through the
config (`op.with_config(dot_precision="ieee")`: an op of its own) instead of overwriting module globals. No torch or
Triton here: the planner imports this module."""

from __future__ import annotations

from dataclasses import dataclass, replace

DOT_PRECISIONS = ("fp16", "fp16x3", "tf32", "tf32x3", "ieee", "bf16")
GRAD_PRECISIONS = ("fp16x3", "tf32x3", "tf32", "ieee")


@dataclass(frozen=True)
class RecurrenceConfig:
    iterations: int  # Chebyshev steps: the op's default num_iter (the spec's `iterations = r`)
    ridge: float  # lambda_t = ridge ||H_t||_F: the op's default ridge (the spec's constant)
    output_factor: float = 1.0  # the output's constant factors beside the scale input
    scaling_input: bool = True  # the spec scales keys and values by an input (beta); None then means no scaling
    chunk: int = 64  # tokens per chunk: the op's default chunk_size
    ridge_offset: float = 0.0  # lambda_t = ridge ||H_t||_F + ridge_offset: the op's default (the spec's constant)
    # Operand precision of the in-kernel products (accumulation is always fp32). None: by input dtype ("ieee" for
    # fp32 inputs, split "fp16x3" for 16-bit ones; kernel.py's solve_precision). Or one of
    # DOT_PRECISIONS everywhere. NCD_GKA_DOT_PRECISION fills it (with_settings) when None.
    dot_precision: str | None = None
    # The backward's accumulation kernels: None is "fp16x3" (or dot_precision where that names one precision
    # everywhere); NCD_GKA_GRAD_PRECISION fills it when None.
    grad_precision: str | None = None
    # State tile (rows, columns, warps) of one scan program, forward and backward (H100, T = 8192,
    # bench/log/2026-11-20-to-22.md)
    scan_tiles_fwd: tuple[int, int, int] = (64, 64, 4)
    scan_tiles_bwd: tuple[int, int, int] = (32, 64, 4)
    scan_stages: int = 3  # the forward scan's pipelined key loads (H200: 2 stages 6-20% slower, 4 the same)
    output_bv: int = 64  # value columns per block of the solve's output epilogue
    poison_outputs: bool = False  # fill every output buffer with NaN before the kernels write it (tests)

    def __post_init__(self) -> None:
        if self.dot_precision not in (None, *DOT_PRECISIONS):
            raise ValueError(f"dot_precision must be None or one of {', '.join(DOT_PRECISIONS)}, "
                             f"not {self.dot_precision!r}")
        if self.grad_precision not in (None, *GRAD_PRECISIONS):
            raise ValueError(f"grad_precision must be None or one of {', '.join(GRAD_PRECISIONS)}, "
                             f"not {self.grad_precision!r}")
        if self.chunk not in (16, 32, 64, 128):
            raise ValueError(f"chunk must be 16, 32, 64 or 128, not {self.chunk}")

    def with_settings(self) -> RecurrenceConfig:
        """The precisions left None filled from NCD_GKA_DOT_PRECISION and NCD_GKA_GRAD_PRECISION (read now)."""
        from ncd.settings import settings

        current = settings()
        return replace(self, dot_precision=self.dot_precision or current.gka_dot_precision,
                       grad_precision=self.grad_precision or current.gka_grad_precision)

    def split_products(self) -> bool:
        """Whether the solve multiplies fp32-class products (the default: ieee for fp32 inputs, fp16x3 for 16-bit
        ones; or fp16x3, tf32x3, ieee set here or by NCD_GKA_DOT_PRECISION), not one 10-bit product."""
        return self.with_settings().dot_precision in (None, "fp16x3", "tf32x3", "ieee")

    def describe(self) -> list[str]:
        by_dtype = "by input dtype (fp32: ieee, 16-bit: fp16x3; NCD_GKA_DOT_PRECISION overrides)"
        return [
            "config:",
            f"  iterations {self.iterations}, ridge {self.ridge:g}, ridge offset {self.ridge_offset:g}, "
            f"output factor {self.output_factor:g}, "
            f"chunk {self.chunk}, scaling input {'yes' if self.scaling_input else 'no (constant scalings)'}",
            f"  products: solve/output/norm {self.dot_precision or by_dtype}; backward accumulation "
            f"{self.grad_precision or 'fp16x3 (NCD_GKA_GRAD_PRECISION overrides)'}",
            f"  scan tiles (rows, columns, warps): forward {self.scan_tiles_fwd} with {self.scan_stages} stages, "
            f"backward {self.scan_tiles_bwd}; output value block {self.output_bv}",
        ]


@dataclass(frozen=True)
class LinearScanConfig:
    """What the plan of a gated linear attention (kernel_linear.py) decides for its kernels."""

    chunk: int = 64  # tokens per chunk: the op's default chunk_size
    output_factor: float = 1.0  # the output's constant factors beside the scale input
    # Operand precision for fp32 inputs (16-bit inputs multiply their own type): None is tf32x3
    dot_precision: str | None = None
    # The backward's products for 16-bit inputs: "tf32" (fp32 states, TF32 operands: the gate gradient within
    # 5e-3 of the float64 recurrence) or "input" (the inputs' type, as the forward's)
    grad_precision: str = "tf32"
    scan_tiles: tuple[int, int, int] = (64, 64, 4)  # state tile (keys, values) and warps of one scan program
    poison_outputs: bool = False  # fill every output buffer with NaN before the kernels write it (tests)

    def __post_init__(self) -> None:
        if self.dot_precision not in (None, "tf32", "tf32x3", "ieee"):
            raise ValueError(f"dot_precision must be None, tf32, tf32x3 or ieee, not {self.dot_precision!r}")
        if self.chunk not in (16, 32, 64, 128):
            raise ValueError(f"chunk must be 16, 32, 64 or 128, not {self.chunk}")
        if self.grad_precision not in ("tf32", "input"):
            raise ValueError(f"grad_precision must be tf32 or input, not {self.grad_precision!r}")

    def describe(self) -> list[str]:
        return [
            "config:",
            f"  chunk {self.chunk}, output factor {self.output_factor:g}; products: the inputs' 16-bit type, fp32 "
            f"inputs {self.dot_precision or 'tf32x3'}; backward for 16-bit inputs {self.grad_precision}; scan tile "
            f"(keys, values, warps) {self.scan_tiles}",
        ]
