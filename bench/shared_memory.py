"""Shared memory of every GKA kernel at head size 128, compiled for Hopper (sm_90) on a machine without a GPU.

Runs the op once under Triton's CPU interpreter (fp32 or bf16 inputs, forward and backward) to record each
kernel's arguments, then compiles each kernel for `GPUTarget("cuda", 90, 128)` with the ptxas bundled in the Triton
wheel, and prints the shared memory each needs against the H100's 232,448 bytes per block. The product precision
is the op's default for the dtype unless --prec names one for every kernel that takes PREC.

    python bench/shared_memory.py [--dtype float32|bfloat16] [--prec ieee|tf32x3|...] [--all-configs] [--dump DIR]

--dump writes each kernel's TTGIR and PTX with source locations and the PTX's DWARF sections stripped, so that two
trees' kernels can be diffed (PYTHONPATH selecting the tree). The kernels live in
ncd/families/recurrence/kernel.py, the spec's scalings come from the generated module as constexpr device
functions (recorded by name).

Measured (2026-11-25, Triton 3.9 here): fp32 inputs with tf32x3 products put `_solve` at 262,144 bytes, exactly
what the H100 (Triton 3.6) reported when it refused the launch; with ieee products (the default) at 147,456.
A fresh Triton cache takes about 2 minutes for the ten kernels of one configuration each.
Issue 31 (static kernels with the spec's hooks as constexprs, 2026-11-25): the same shared memory as the templated
kernels for every kernel (fp32 inputs: 147,456 B at most; bf16: 98,304 B), and the same TTGIR and PTX code (the PTX
compared up to its DWARF sections, which name the source files) at both dtypes.
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
    """A launch argument as JSON: tensors by dtype (they become pointers), device functions (the spec's hooks,
    constexprs) by name, the rest as they are."""
    if isinstance(value, torch.Tensor):
        return {"tensor": str(value.dtype).removeprefix("torch.")}
    if callable(value):  # a JIT function (under the interpreter, an InterpretedFunction)
        return {"jit": getattr(value, "__name__", None) or value.fn.__name__}
    return value


def _kernels(module):
    """Where the kernels live: the static module the generated one calls (ncd/families/recurrence/kernel.py)."""
    return getattr(module, "_kernels", module)


def _resolve(value, module):
    """A recorded argument back as a launch takes it: a device function by name from the generated module (the
    spec's hooks) or the kernels' module."""
    if isinstance(value, dict) and "jit" in value:
        return getattr(module, value["jit"], None) or getattr(_kernels(module), value["jit"])
    return value


def record(dtype: torch.dtype, path: str) -> None:
    """In the interpreter: each kernel's first launch (the forward's solve, which writes the output, as
    `_solve_out`), written to `path` as JSON."""
    module = load(shipped_spec("gka"), sizes={"kdim": 128, "vdim": 128}).module
    seen: dict[str, tuple[tuple, dict]] = {}
    kernels = _kernels(module)
    fast = kernels._fast

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

    kernels._fast = spy
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
        kernels._fast = fast
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


def _dump(folder: str, stem: str, compiled) -> None:
    """The kernel's TTGIR and PTX without source locations and the PTX's DWARF sections (file names and line
    numbers differ between trees)."""
    os.makedirs(folder, exist_ok=True)
    for ext in ("ttgir", "ptx"):
        lines = []
        for line in compiled.asm[ext].splitlines():
            if line.lstrip().startswith(".section") and ".debug" in line:
                break
            if not line.lstrip().startswith((".loc", ".file", "#loc", "$L__")):
                lines.append(line)
        text = "\n".join(line.split(" loc(")[0] for line in lines)
        with open(os.path.join(folder, f"{stem}.{ext}"), "w") as handle:
            handle.write(text + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--prec", default=None, help="one product precision for every kernel with PREC")
    parser.add_argument("--all-configs", action="store_true", help="num_warps 4 and 8, num_stages 1 and 2")
    parser.add_argument("--dump", metavar="DIR", help="write each kernel's TTGIR and PTX there (to diff two trees)")
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
        kernel = getattr(_kernels(module), name.removesuffix("_out"))
        kwargs = {key: _resolve(value, module) for key, value in kwargs.items()}
        launch = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
        for config in [launch] if launch else configs:
            compiled = compile_for_hopper(kernel, kargs, kwargs, args.prec, config)
            shared = compiled.metadata.shared
            if args.dump:
                _dump(args.dump, f"{name}_w{config.get('num_warps')}s{config.get('num_stages')}", compiled)
            worst = max(worst, shared)
            prec = args.prec if args.prec and "PREC" in kwargs else kwargs.get("PREC", "-")
            print(f"{name:18s} PREC {prec!s:7s} {config}  shared {shared:7d} B  "
                  f"{'fits' if shared <= H100_SHARED else 'OVER the H100'}")
    print(f"largest: {worst} B of {H100_SHARED} ({args.dtype} inputs, K = V = 128)")


if __name__ == "__main__":
    main()
