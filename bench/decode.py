"""GPU check and benchmark of split-K decoding (ncd/families/attention/kernel_decode.py), issue 32 item 5.

    PYTHONUNBUFFERED=1 python3 bench/decode.py [--quick] [--sweep]

bf16, D = 128, 16 query heads, B = 8 (the issue's target: q = 1, KV = 32k), GQA groups 1 and 4. For each shape:
softmax from the spec (softmax_attention.ncd) by the standard forward (`KERNELS.forward`) and by `decode_forward`
(K, V by pointers and by TMA: `decode_tma`), SDPA (`F.scaled_dot_product_attention`, enable_gqa) and FlexAttention
(`torch.compile(flex_attention)`, where importable). Correctness first: the decode output against an fp32 SDPA of
the same inputs (< 1e-2 relative, Frobenius) and its M + log Z against the standard forward's. `--sweep`: every
(tma, block_n, splits) of a small grid at the target shape, to set kernel_decode's constants (USE_TMA,
decode_block_n, decode_splits). Forward only (decoding). With $OUT set, the rows go to $OUT/decode_bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

try:
    import ncd
except ImportError:  # not installed: use the checkout this script lives in
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import ncd
from ncd.families.attention import kernel_decode as dec

SPEC = Path(__file__).resolve().parent.parent / "specs" / "softmax_attention.ncd"
HEADS, DIM, BATCH = 16, 128, 8
DTYPE = torch.bfloat16


def _flex():
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError:
        return None
    return torch.compile(flex_attention, dynamic=False)


def _time(fn, *args, **kwargs) -> float:
    """Median milliseconds of fn(*args, **kwargs)."""
    return do_bench(lambda: fn(*args, **kwargs))


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="the target shape only")
    parser.add_argument("--sweep", action="store_true", help="(splits, block_n) sweep at the target shape")
    args = parser.parse_args()
    kernels = ncd.load(SPEC).module.KERNELS
    flex = _flex()
    shapes = [(1, 32768, 1)] if args.quick else [
        (n_q, n_k, group) for n_q in (1, 4, 16) for n_k in (4096, 32768) for group in (1, 4)]
    rows, failed = [], False
    for n_q, n_k, group in shapes:
        hkv = HEADS // group
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(BATCH, HEADS, n_q, DIM, device="cuda", dtype=DTYPE, generator=g)
        k = torch.randn(BATCH, hkv, n_k, DIM, device="cuda", dtype=DTYPE, generator=g)
        v = torch.randn(BATCH, hkv, n_k, DIM, device="cuda", dtype=DTYPE, generator=g)
        scale = DIM**-0.5
        o_std, (z_std, m_std) = kernels.forward(q, k, v, None, scale)
        o_dec, (z_dec, m_dec) = dec.decode_forward(kernels, q, k, v, None, scale)
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=scale, enable_gqa=group > 1)
        errors = {"decode_vs_fp32": _error(o_dec, ref), "standard_vs_fp32": _error(o_std, ref),
                  "lse_vs_standard": float(((m_dec + z_dec.log()) - (m_std + z_std.log())).abs().max())}
        failed |= errors["decode_vs_fp32"] > 1e-2 or errors["lse_vs_standard"] > 1e-3
        times = {
            "standard": _time(kernels.forward, q, k, v, None, scale),
            "decode": _time(dec.decode_forward, kernels, q, k, v, None, scale),
            "decode_tma": _time(dec.decode_forward, kernels, q, k, v, None, scale, tma=True),
            "sdpa": _time(F.scaled_dot_product_attention, q, k, v, scale=scale, enable_gqa=group > 1),
        }
        if flex is not None:
            times["flex"] = _time(flex, q, k, v, scale=scale, enable_gqa=group > 1)
        row = {"n_q": n_q, "n_k": n_k, "group": group, "use_decode": dec.use_decode(n_q, n_k, BATCH * HEADS),
               **errors, **{f"{name}_ms": t for name, t in times.items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.sweep:
        n_q, n_k = 1, 32768
        for group in (1, 4):
            q = torch.randn(BATCH, HEADS, n_q, DIM, device="cuda", dtype=DTYPE)
            k = torch.randn(BATCH, HEADS // group, n_k, DIM, device="cuda", dtype=DTYPE)
            v = torch.randn_like(k)
            sdpa = _time(F.scaled_dot_product_attention, q, k, v, enable_gqa=group > 1)
            grid = [(tma, block_n, splits, warps, stages) for tma in (False, True) for block_n in (64, 128)
                    for splits in (1, 2, 3, 4, 5, 8, 16) for warps in (4, 8) for stages in (2, 3, 4)]
            for tma, block_n, splits, warps, stages in grid:
                try:
                    ms = _time(dec.decode_forward, kernels, q, k, v, None, None, splits=splits, block_n=block_n,
                               tma=tma, num_warps=warps, num_stages=stages)
                except Exception as error:  # out of shared memory at large tiles x stages
                    ms = None
                    print(f"skip {tma} {block_n} {splits} {warps} {stages}: {type(error).__name__}", flush=True)
                row = {"sweep": True, "group": group, "tma": tma, "block_n": block_n, "splits": splits,
                       "warps": warps, "stages": stages, "decode_ms": ms, "sdpa_ms": sdpa}
                rows.append(row)
                print(json.dumps(row), flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "decode_bench.json").write_text(json.dumps(rows, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
