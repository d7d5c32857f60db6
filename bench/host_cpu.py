"""Host time per call of the generated ops on a machine without a GPU, this checkout against an older commit in the
same process, with every kernel launch stubbed out.

    python bench/host_cpu.py [--old 637edd4 [--old REV ...]] [--rounds 200] [--calls 20] [--only CASE]
    python bench/host_cpu.py --gpu --old old-637edd4.tar   # on a GPU machine: real kernels, same interleaving

Each old commit is extracted (`git archive`) into /tmp and its package renamed `ncd_<commit>` (imports and
package-data names rewritten), so that all import side by side and are timed in interleaved rounds: on a shared
machine, separate processes differ by more than the few microseconds compared here.

What is stubbed: Triton's JIT `run` and autotuner `run` return a compiled-kernel stand-in whose launcher does
nothing. Everything above it runs as on the GPU machine: ncd's direct launches (ncd/launch.py) are on, the JIT
functions are Triton's compiled-mode ones (TRITON_INTERPRET is unset while the ops load), plans and tiles are an
H100's (132 SMs assumed), streams are 0. Tensors live on the CPU, so PyTorch's host work (allocations, autograd)
is timed too, and what it would run on the GPU (a copy, a gradient accumulation) runs on the CPU here: the cases
avoid those (kernel-layout coefficients, .grad reset before each backward, small sizes where a copy remains).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
SMS = 132  # an H100 SXM's SM count: the plans and tiles the GPU run gets


def package_name(rev: str) -> str:
    return "ncd_" + re.sub(r"\W", "_", Path(rev).stem if rev.endswith(".tar") else rev)


def renamed_copy(rev: str) -> Path:
    """`rev`'s package as `ncd_<rev>` under /tmp/ncd-old-<rev>/ (made once); returns the directory to put on
    sys.path. Symlinked folders (codegen, grammar, templates, specs at older commits) are copied as folders."""
    name = package_name(rev)
    parent = Path(f"/tmp/ncd-old-{name}")
    package = parent / name
    if package.exists():
        return parent
    tree = parent / "tree"
    tree.mkdir(parents=True, exist_ok=True)
    if rev.endswith(".tar"):  # `git archive -o old.tar REV`, for a copy of the tree without git history
        subprocess.run(["tar", "-x", "-C", str(tree), "-f", str(Path(rev).resolve())], check=True)
    else:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    subprocess.run(["cp", "-rL", str(tree / "ncd"), str(package)], check=True)
    for sub in ("codegen", "grammar", "templates", "specs"):  # packaged from the top level without symlinks
        if (tree / sub).is_dir() and not (package / sub).exists():
            subprocess.run(["cp", "-r", str(tree / sub), str(package / sub)], check=True)
    rules = [(r"\bfrom ncd([. ])", rf"from {name}\1"), (r"\bimport ncd\.", f"import {name}."),
             (r"\bimport ncd$", f"import {name}"), (r"\"ncd\.", f'"{name}.'),
             (r"\{\"ncd\": ", f'{{"{name}": ')]
    for path in [*package.rglob("*.py"), *package.rglob("*.jinja")]:
        text = path.read_text(encoding="utf-8")
        for pattern, repl in rules:
            text = re.sub(pattern, repl, text, flags=re.MULTILINE)
        path.write_text(text, encoding="utf-8")
    lark = package / "grammar" / "ncd.lark"
    if lark.exists():  # its loader's string was renamed with the rest
        lark.rename(package / "grammar" / f"{name}.lark")
    return parent


class _Compiled:
    """What `kernel[grid](...)` returns, with a launcher that does nothing."""

    function = packed_metadata = None

    @staticmethod
    def run(*args: object) -> None:
        return None

    @staticmethod
    def launch_metadata(*args: object) -> None:
        return None


def stub_launches(packages: list[ModuleType]) -> None:
    """Kernel launches become no-ops; everything above Triton's launcher runs as on a GPU."""
    import torch
    from triton.runtime import autotuner, jit

    compiled = _Compiled()
    jit.JITFunction.run = lambda self, *args, **kwargs: compiled

    def autotuner_run(self, *args, **kwargs):
        self.best_config = self.configs[0]
        return compiled

    autotuner.Autotuner.run = autotuner_run
    for package in packages:
        name = package.__name__
        with contextlib.suppress(ImportError):  # before ncd/tuning.py: Triton's autotuner (patched above)
            importlib.import_module(f"{name}.tuning").PersistentAutotuner.run = autotuner_run
        launch = importlib.import_module(f"{name}.launch")
        launch._enabled = lambda enabled: True if enabled is None else enabled
        launch._current_device = lambda: 0
        launch._current_stream = lambda device: 0
    torch._C._cuda_getCurrentRawStream = lambda index: 0

    class _Properties:
        multi_processor_count = SMS

    torch.cuda.get_device_properties = lambda index=None: _Properties()
    torch.cuda.current_device = lambda: 0


def _polykan_layer(package: ModuleType):
    if (Path(package.__file__).parent / "polykan.py").exists():  # before ncd/families
        return importlib.import_module(f"{package.__name__}.polykan").PolyKANLayer
    return importlib.import_module(f"{package.__name__}.families.polykan.plan").PolyKANLayer


DEVICE = "cpu"  # "cuda" with --gpu


def polykan_cases(package: ModuleType, batch: int, inp: int, outp: int, degree: int, layout: str) -> dict:
    import torch

    torch.manual_seed(0)
    layer = _polykan_layer(package)(inp, outp, degree, layout=layout).to(DEVICE)
    x = torch.randn(batch, inp, requires_grad=True, device=DEVICE)
    dy = torch.randn(batch, outp, device=DEVICE)
    params = [x, *layer.parameters()]
    tag = f"cheby_kan x[{batch},{inp}] o{outp} d{degree} {layout}"

    def no_grad():
        with torch.no_grad():
            layer(x)

    def fwd_bwd():
        for p in params:
            p.grad = None
        layer(x).backward(dy)

    return {f"{tag} fwd (no grad)": no_grad, f"{tag} fwd (grad)": lambda: layer(x), f"{tag} fwd+bwd": fwd_bwd}


def rational_cases(package: ModuleType, rows: int, groups: int, width: int) -> dict:
    import torch

    torch.manual_seed(0)
    op = package.load(ROOT / "specs" / "kat_rational.ncd")
    x = torch.randn(rows, groups * width, requires_grad=True, device=DEVICE)
    a = torch.randn(6, requires_grad=True, device=DEVICE)
    b = torch.randn(groups, 4, requires_grad=True, device=DEVICE)
    dy = torch.randn_like(x)
    tag = f"kat_rational x[{rows},{groups * width}]"

    def no_grad():
        with torch.no_grad():
            op(x, a, b)

    def fwd_bwd():
        for p in (x, a, b):
            p.grad = None
        op(x, a, b).backward(dy)

    return {f"{tag} fwd (no grad)": no_grad, f"{tag} fwd (grad)": lambda: op(x, a, b), f"{tag} fwd+bwd": fwd_bwd}


def attention_cases(package: ModuleType, stem: str, shape: tuple[int, int, int, int]) -> dict:
    import torch

    torch.manual_seed(0)
    op = package.load(ROOT / "specs" / f"{stem}.ncd")
    q, k, v = (torch.randn(shape, dtype=torch.bfloat16, requires_grad=True, device=DEVICE) for _ in range(3))
    do = torch.randn(shape, dtype=torch.bfloat16, device=DEVICE)
    tag = f"{stem} {list(shape)} bf16"

    def no_grad():
        with torch.no_grad():
            op(q, k, v)

    def fwd_bwd():
        for t in (q, k, v):
            t.grad = None
        op(q, k, v).backward(do)

    return {f"{tag} fwd (no grad)": no_grad, f"{tag} fwd (grad)": lambda: op(q, k, v), f"{tag} fwd+bwd": fwd_bwd}


def cases(package: ModuleType, only: str = "") -> dict:
    """Every case whose name contains one of `only`'s comma-separated parts."""
    makers = [  # (the case names' common part, the cases)
        ("cheby_kan x[64,256] o512 d15 kernel", lambda: polykan_cases(package, 64, 256, 512, 15, "kernel")),
        # small: the CPU copies the coefficients
        ("cheby_kan x[16,24] o16 d3 spec", lambda: polykan_cases(package, 16, 24, 16, 3, "spec")),
        ("kat_rational x[64,128]", lambda: rational_cases(package, 64, 8, 16)),
        ("causal_spherical_attention [1, 2, 64, 128] bf16",
         lambda: attention_cases(package, "causal_spherical_attention", (1, 2, 64, 128))),
    ]
    if DEVICE == "cuda":  # the polynomial-KAN paper configs of bench/polykan.py, real kernels
        makers += [(f"cheby_kan x[{b},{i}] o{o} d{d} {layout}",
                    lambda b=b, i=i, o=o, d=d, layout=layout: polykan_cases(package, b, i, o, d, layout))
                   for b, i, o, d in ((128, 40, 256, 8), (32, 512, 1024, 24)) for layout in ("kernel", "spec")]
    wanted = only.split(",")
    found = {}
    for tag, make in makers:
        if any(w in f"{tag} {what}" for w in wanted for what in ("fwd (no grad)", "fwd (grad)", "fwd+bwd")):
            found.update(make())
    return {name: fn for name, fn in found.items() if any(w in name for w in wanted)}


def _round_us(fn, calls: int) -> float:
    if DEVICE == "cuda":
        import torch

        torch.cuda.synchronize()
    t0 = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter_ns() - t0) / calls / 1e3


def interleaved(fns: list, rounds: int, calls: int) -> tuple[list[float], list[float]]:
    """Per function: the best of `rounds` rounds of `calls` calls, and the median over rounds of its time over the
    first function's; each round runs every function, in an order that rotates. On a busy machine the best of many
    short rounds is the least disturbed measurement; the median ratio shows the noise."""
    for _ in range(20):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for r in range(rounds):
        order = list(range(len(fns)))
        order = order[r % len(fns):] + order[:r % len(fns)]
        for i in order:
            times[i].append(_round_us(fns[i], calls))
    return [min(t) for t in times], [statistics.median(a / b for a, b in zip(t, times[0], strict=True)) for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", action="append", help="a commit to compare with (repeatable; default 637edd4)")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--only", default="", help="run the cases whose name contains one of these (comma list)")
    parser.add_argument("--gpu", action="store_true", help="real kernels on the GPU (wall time per call, "
                        "synchronised per round), no stubs; --old may name a `git archive` tar file")
    args = parser.parse_args()
    global DEVICE
    DEVICE = "cuda" if args.gpu else "cpu"
    revs = args.old or ["637edd4"]
    for rev in revs:
        sys.path.insert(0, str(renamed_copy(rev)))
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.setdefault("NCD_CACHE_DIR", f"/tmp/ncd-host-cpu-cache-{os.getuid()}")
    import torch

    import ncd

    packages = [importlib.import_module(package_name(rev)) for rev in revs] + [ncd]
    if not args.gpu:
        stub_launches(packages)
        torch.set_num_threads(1)
    per_package = [cases(package, args.only) for package in packages]
    if not args.gpu:  # the call-time device check accepts CPU tensors only under the interpreter
        os.environ["TRITON_INTERPRET"] = "1"
    where = (f"GPU {torch.cuda.get_device_name()}, real kernels" if args.gpu
             else f"kernels stubbed, CPU ({os.cpu_count()} cores, shared)")
    print(f"us per call, {where}; best of {args.rounds} rounds of {args.calls} calls, interleaved; ratio: this "
          f"checkout / {revs[0]} (best, and median of the rounds)")
    print(f"  {'case':<52}" + "".join(f" {rev[:8]:>8}" for rev in revs) + f" {'now':>8} {'ratio':>6} {'median':>6}")
    for name in per_package[-1]:
        best, ratios = interleaved([found[name] for found in per_package], args.rounds, args.calls)
        print(f"  {name:<52}" + "".join(f" {t:8.1f}" for t in best) + f" {best[-1] / best[0]:6.3f} {ratios[-1]:6.3f}",
              flush=True)


if __name__ == "__main__":
    main()
