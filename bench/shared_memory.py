"""Shared memory of every GKA kernel at head size 128, compiled for Hopper (sm_90) on a machine without a GPU.

Runs the op once under Triton's CPU interpreter (fp32 or bf16 inputs, forward and backward) to record each
kernel's arguments, then compiles each kernel for `GPUTarget("cuda", 90, 128)` with the ptxas bundled in the Triton
wheel, and prints the shared memory each needs against the H100's 232,448 bytes per block. The product precision
is the op's default for the dtype unless --prec names one for every kernel that takes PREC.

    python bench/shared_memory.py [--dtype float32|bfloat16] [--prec ieee|tf32x3|...] [--all-configs]

Measured (2026-11-25, Triton 3.9 here): fp32 inputs with tf32x3 products put `_solve` at 262,144 bytes, exactly
what the H100 (Triton 3.6) reported when it refused the launch; with ieee products (the default) at 147,456.
A fresh Triton cache takes about 2 minutes for the ten kernels of one configuration each.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ncd.ops import load, shipped_spec

H100_SHARED = 232_448
POINTER = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.int32: "*i32",
           torch.int64: "*i64"}


def _describe(value):
    """A launch argument as JSON: tensors by dtype (they become pointers), the rest as they are."""
    return {"tensor": str(value.dtype).removeprefix("torch.")} if isinstance(value, torch.Tensor) else value


def record(dtype: torch.dtype, path: str) -> None:
    """In the interpreter: each kernel's first launch (the forward's solve, which writes the output, as
    `_solve_out`), written to `path` as JSON."""
    module = load(shipped_spec("gka"), sizes={"kdim": 128, "vdim": 128}).module
    seen: dict[str, tuple[tuple, dict]] = {}
    fast = module._fast

    def spy(kernel):
        launcher = fast(kernel)
        name = kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__

        class Grid:
            def __getitem__(self, grid):
                run = launcher[grid]

                def call(*args, **kwargs):
                    seen.setdefault(name + ("_out" if kwargs.get("OUTPUT") else ""), (args, kwargs))
                    return run(*args, **kwargs)
                return call
        return Grid()

    module._fast = spy
    try:
        torch.manual_seed(0)
        b, t, h, d = 1, 70, 1, 128
        q = F.normalize(torch.randn(b, t, h, d), dim=-1).to(dtype)
        k = F.normalize(torch.randn(b, t, h, d), dim=-1).to(dtype)
        v = torch.randn(b, t, h, d).to(dtype)
        g, beta = F.logsigmoid(torch.randn(b, t, h) + 3), torch.sigmoid(torch.randn(b, t, h))
        leaves = [x.requires_grad_() for x in (q, k, v, g, beta)]
        module.chunk(*leaves)[0].float().sum().backward()
    finally:
        module._fast = fast
    with open(path, "w") as handle:
        json.dump({name: ([_describe(a) for a in a_], {k: _describe(v) for k, v in kw.items()})
                   for name, (a_, kw) in seen.items()}, handle)


def _jit(kernel):
    while not isinstance(kernel, triton.runtime.jit.JITFunction):
        kernel = kernel.fn
    return kernel


def compile_for_hopper(kernel, args: tuple, kwargs: dict, prec: str | None, config: dict):
    jit = _jit(kernel)
    kwargs = {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")}
    if prec and "PREC" in kwargs:
        kwargs["PREC"] = prec
    values = {**dict(zip(jit.arg_names, args, strict=False)), **kwargs}
    signature, constants = {}, {}
    for i, (name, param) in enumerate(zip(jit.arg_names, jit.params, strict=True)):
        value = values[name]
        if param.is_constexpr:
            signature[name], constants[(i,)] = "constexpr", value
        elif isinstance(value, dict):
            signature[name] = POINTER[getattr(torch, value["tensor"])]
        elif isinstance(value, bool):
            signature[name] = "i1"
        else:
            signature[name] = "i32" if isinstance(value, int) else "fp32"
    return triton.compile(ASTSource(jit, signature, constants), target=GPUTarget("cuda", 90, 128), options=config)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--prec", default=None, help="one product precision for every kernel with PREC")
    parser.add_argument("--all-configs", action="store_true", help="num_warps 4 and 8, num_stages 1 and 2")
    parser.add_argument("--record", metavar="JSON", help=argparse.SUPPRESS)  # the interpreter run (internal)
    args = parser.parse_args()
    if args.record:
        record(getattr(torch, args.dtype), args.record)
        return
    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "launches.json")
        subprocess.run([sys.executable, __file__, "--dtype", args.dtype, "--record", path], check=True,
                       env={**os.environ, "TRITON_INTERPRET": "1"})
        with open(path) as handle:
            seen = json.load(handle)
    os.environ.pop("TRITON_INTERPRET", None)
    module = load(shipped_spec("gka"), sizes={"kdim": 128, "vdim": 128}).module
    configs = ([{"num_warps": w, "num_stages": s} for w in (4, 8) for s in (1, 2)] if args.all_configs
               else [{"num_warps": 4, "num_stages": 1}])
    worst = 0
    for name, (kargs, kwargs) in sorted(seen.items()):
        kernel = getattr(module, name.removesuffix("_out"))
        launch = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
        for config in [launch] if launch else configs:
            shared = compile_for_hopper(kernel, kargs, kwargs, args.prec, config).metadata.shared
            worst = max(worst, shared)
            prec = args.prec if args.prec and "PREC" in kwargs else kwargs.get("PREC", "-")
            print(f"{name:18s} PREC {prec!s:7s} {config}  shared {shared:7d} B  "
                  f"{'fits' if shared <= H100_SHARED else 'OVER the H100'}")
    print(f"largest: {worst} B of {H100_SHARED} ({args.dtype} inputs, K = V = 128)")


if __name__ == "__main__":
    main()
