"""GPU benchmark of the polynomial-KAN family (ncd) against eager, torch.compile and Triton + cuBLAS baselines.

Run from outside the repository so that the installed ncd is imported:
    cd /tmp && python3 /path/to/repo/bench/polykan.py [--no-sweep] [--json PATH]
Sections, in one run: correctness on the GPU (ncd vs a float64 eager reference, every regime and basis
evaluation), timing of every variant side by side (fp32), kernel launches and GPU kernel time per training
step (torch profiler), a sweep of the GEMM regime's tiles at the large config, a 3-layer ChebyKAN MLP with
LayerNorm (eager vs ncd), and a table last.
Timing: CUDA events around `iters` back-to-back calls after warm-up, median of 5 repeats, per call (launch
overhead included: the paper sizes are launch-bound, so host time per call is what is measured there).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import traceback
from typing import Any

import torch
import torch._functorch.config
import triton
import triton.language as tl

import ncd
from ncd.families.polykan.plan import ChebyKANLayer, PolyKANLayer

CONFIGS = [(128, 40, 256, 8), (64, 256, 512, 15), (32, 512, 1024, 24), (4096, 1024, 1024, 8)]
LARGE = CONFIGS[-1]
MID = CONFIGS[1]
SATURATED = (128, 40, 256, 8)
DEV = os.environ.get("BENCH_DEVICE", "cuda")  # "cpu" (with TRITON_INTERPRET=1) only to smoke-test this script
OUT = os.environ.get("OUT", "/tmp")
JSON_PATH = sys.argv[sys.argv.index("--json") + 1] if "--json" in sys.argv[1:-1] else None  # bench/results.py
LINES: list[str] = []
MAIN = "ncd (LUT, kernel layout)"
# the bwd-only timing replays one graph (retain_graph=True): compiled backwards must not donate buffers
torch._functorch.config.donated_buffer = False


def log(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)


# --- baselines --------------------------------------------------------------------------------------------


class EagerAcos(torch.nn.Module):
    """ChebyKAN's reference layer (acos / cos + einsum)."""

    def __init__(self, inp: int, outp: int, degree: int) -> None:
        super().__init__()
        self.inputdim, self.outdim, self.degree = inp, outp, degree
        self.cheby_coeffs = torch.nn.Parameter(torch.empty(inp, outp, degree + 1))
        torch.nn.init.normal_(self.cheby_coeffs, mean=0.0, std=1 / (inp * (degree + 1)))
        self.register_buffer("arange", torch.arange(0, degree + 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.reshape(x, (-1, self.inputdim))
        x = torch.tanh(x)
        x = x.view((-1, self.inputdim, 1)).expand(-1, -1, self.degree + 1)
        x = x.acos()
        x = x * self.arange
        x = x.cos()
        y = torch.einsum("bid,iod->bo", x, self.cheby_coeffs)
        return y.view(-1, self.outdim)


def recurrence_basis(u: torch.Tensor, degree: int, basis: str = "chebyshev") -> torch.Tensor:
    terms = [torch.ones_like(u), (2 * u if basis == "hermite" else u)]
    for n in range(1, degree):
        if basis == "chebyshev":
            terms.append(2 * u * terms[-1] - terms[-2])
        elif basis == "legendre":
            terms.append(((2 * n + 1) * u * terms[-1] - n * terms[-2]) / (n + 1))
        else:
            terms.append(2 * u * terms[-1] - 2 * n * terms[-2])
    return torch.stack(terms[: degree + 1], dim=-1)


class EagerRecurrence(EagerAcos):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(torch.reshape(x, (-1, self.inputdim)))
        return torch.einsum("bid,iod->bo", recurrence_basis(x, self.degree), self.cheby_coeffs).view(-1, self.outdim)


@triton.jit
def _basis_kernel(x_ptr, phi_ptr, n, D: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = r < n
    u = 2.0 * tl.sigmoid(2.0 * tl.load(x_ptr + r, mask=m, other=0.0)) - 1.0
    prev = tl.full((BLOCK,), 1.0, tl.float32)
    cur = u
    tl.store(phi_ptr + r * D, prev, mask=m)
    if D > 1:
        tl.store(phi_ptr + r * D + 1, cur, mask=m)
    for d in tl.static_range(2, D):
        nxt = 2.0 * u * cur - prev
        tl.store(phi_ptr + r * D + d, nxt, mask=m)
        prev = cur
        cur = nxt


@triton.jit
def _basis_bwd_kernel(x_ptr, dphi_ptr, dx_ptr, n, D: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = r < n
    u = 2.0 * tl.sigmoid(2.0 * tl.load(x_ptr + r, mask=m, other=0.0)) - 1.0
    p_prev = tl.full((BLOCK,), 1.0, tl.float32)
    p_cur = u
    dp_prev = tl.zeros((BLOCK,), tl.float32)
    dp_cur = tl.full((BLOCK,), 1.0, tl.float32)
    acc = tl.zeros((BLOCK,), tl.float32)
    if D > 1:
        acc += tl.load(dphi_ptr + r * D + 1, mask=m, other=0.0) * dp_cur
    for d in tl.static_range(2, D):
        p_nxt = 2.0 * u * p_cur - p_prev
        dp_nxt = 2.0 * p_cur + 2.0 * u * dp_cur - dp_prev
        acc += tl.load(dphi_ptr + r * D + d, mask=m, other=0.0) * dp_nxt
        p_prev, p_cur, dp_prev, dp_cur = p_cur, p_nxt, dp_cur, dp_nxt
    tl.store(dx_ptr + r, acc * (1.0 - u * u), mask=m)


class _TritonBasis(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, degree):  # type: ignore[override]
        x = x.contiguous()
        phi = torch.empty((*x.shape, degree + 1), device=x.device, dtype=torch.float32)
        n = x.numel()
        _basis_kernel[(triton.cdiv(n, 1024),)](x, phi, n, D=degree + 1, BLOCK=1024)
        ctx.save_for_backward(x)
        ctx.degree = degree
        return phi

    @staticmethod
    def backward(ctx, dphi):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        dx = torch.empty_like(x)
        n = x.numel()
        _basis_bwd_kernel[(triton.cdiv(n, 1024),)](x, dphi.contiguous(), dx, n, D=ctx.degree + 1, BLOCK=1024)
        return dx, None


class _Nothing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, c):  # type: ignore[override]
        ctx.save_for_backward(x, c)
        return x.new_empty((x.shape[0], c.shape[1]))

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x, c = ctx.saved_tensors
        return torch.empty_like(x), torch.empty_like(c)


class Floor(EagerAcos):
    """Host-overhead floor, not a baseline: one autograd.Function, outputs allocated, no kernels."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Nothing.apply(x, self.cheby_coeffs)


class TritonCublas(torch.nn.Module):
    """Triton basis kernel (recurrence) writing [B, Din*(d+1)], then cuBLAS: weight stored [Din*(d+1), Dout]."""

    def __init__(self, eager: EagerAcos) -> None:
        super().__init__()
        self.inputdim, self.outdim, self.degree = eager.inputdim, eager.outdim, eager.degree
        w = eager.cheby_coeffs.detach().permute(0, 2, 1).reshape(-1, eager.outdim).contiguous()
        self.weight = torch.nn.Parameter(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        phi = _TritonBasis.apply(torch.reshape(x, (-1, self.inputdim)), self.degree)
        return phi.reshape(phi.shape[0], -1) @ self.weight


# --- timing -----------------------------------------------------------------------------------------------


def bench(fn, iters: int = 50, repeats: int = 5) -> float:
    """ms per call: CUDA events around `iters` calls, median over repeats."""
    for _ in range(3):
        fn()
    if DEV == "cpu":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


def measure(layer: torch.nn.Module, x: torch.Tensor, g: torch.Tensor, iters: int) -> tuple[float, float, float]:
    params = [p for p in layer.parameters()]

    def fwd() -> None:
        with torch.no_grad():
            layer(x)

    def fwdbwd() -> None:
        y = layer(x)
        torch.autograd.grad(y, [x, *params], g)

    t_fwd = bench(fwd, iters)
    t_fb = bench(fwdbwd, iters)
    y = layer(x)

    def bwd() -> None:
        torch.autograd.grad(y, [x, *params], g, retain_graph=True)

    t_bwd = bench(bwd, iters)
    return t_fwd, t_bwd, t_fb


def profile_step(layer: torch.nn.Module, x: torch.Tensor, g: torch.Tensor, steps: int = 10,
                 kernels: dict | None = None) -> tuple[float, float]:
    """(CUDA kernels / memsets launched, GPU busy time in ms) per forward+backward step (torch profiler);
    `kernels` receives name -> us per step."""
    from torch.profiler import ProfilerActivity, profile

    if DEV == "cpu":
        return 0.0, 0.0
    params = [p for p in layer.parameters()]
    for _ in range(2):
        torch.autograd.grad(layer(x), [x, *params], g)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            torch.autograd.grad(layer(x), [x, *params], g)
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    busy = sum(e.time_range.elapsed_us() for e in events) / 1e3
    if kernels is not None:
        for e in events:
            kernels[e.name] = kernels.get(e.name, 0.0) + e.time_range.elapsed_us() / steps
    return len(events) / steps, busy / steps


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def ncd_layer(i: int, o: int, d: int, basis: str = "chebyshev", **kw) -> PolyKANLayer:
    if basis == "chebyshev":
        return ChebyKANLayer(i, o, d, **kw)
    return PolyKANLayer(i, o, d, basis, **kw)


def bf16_layer(i: int, o: int, d: int) -> ChebyKANLayer:
    """ChebyKANLayer compiled with matmul=bf16x3 (the GEMM regime's operands as bf16 parts)."""
    layer = ChebyKANLayer(i, o, d, layout="kernel")
    op = ncd.load(ncd.families.polykan.plan.spec_path("chebyshev"), sizes={"deg": d + 1}, options={"matmul": "bf16x3"})
    layer._op, layer._fn = op, op.fn
    return layer


# --- sections ---------------------------------------------------------------------------------------------


def with_config(layer: torch.nn.Module, base: Any = None, **fields: Any) -> torch.nn.Module:
    """`layer` running its op (or `base`) compiled with `fields` of its config replaced (`Op.with_config`: the
    regime, tiles, precisions are the config's, not module globals)."""
    layer._op = (base or layer._op).with_config(**fields)
    layer._fn = layer._op.fn
    return layer


def correctness() -> bool:
    log("## correctness on the GPU (ncd fp32 vs float64 eager reference; relative L2 errors; limit 1e-4)")
    ok = True
    cases = [(*cfg, "chebyshev", "lut", None) for cfg in CONFIGS]
    cases += [(*cfg, "chebyshev", "recurrence", None) for cfg in CONFIGS]
    cases += [(*MID, "legendre", "lut", None), (*MID, "hermite", "recurrence", None)]
    cases += [(*MID, "chebyshev", "lut", "gemm")]
    cases += [(*LARGE, "chebyshev", "lut", "bf16x3")]
    for b, i, o, d, basis, mode, special in cases:
        torch.manual_seed(0)
        layer = bf16_layer(i, o, d).to(DEV) if special == "bf16x3" else ncd_layer(i, o, d, basis,
                                                                                   basis_eval=mode).to(DEV)
        if special == "gemm":
            with_config(layer, regime="gemm")
        module = layer._op.module
        x = (torch.randn(b, i, device=DEV) * 2).requires_grad_(True)
        gy = torch.randn(b, o, device=DEV)
        first = torch.autograd.grad(layer(x), [x, layer.coefficients], gy)
        y = layer(x)  # the second step takes the direct launches: checked, and bitwise equal to the first
        dx, dc = torch.autograd.grad(y, [x, layer.coefficients], gy)
        same = torch.equal(first[0], dx) and torch.equal(first[1], dc)
        with torch.no_grad():
            y_ng = layer(x)
        regime = next(iter(module._PLANS.values())).til.regime
        xd = x.detach().double().requires_grad_(True)
        cd = layer.coefficients.detach().double().requires_grad_(True)
        yr = torch.einsum("bid,iod->bo", recurrence_basis(torch.tanh(xd), d, basis), cd)
        dxr, dcr = torch.autograd.grad(yr, [xd, cd], gy.double())
        errs = (rel(y, yr), rel(dx, dxr), rel(dc, dcr), rel(y_ng, yr))
        good = all(e < 1e-4 for e in errs) and same
        ok &= good
        log(f"  {basis:9s} {mode:10s} {regime:5s}{' bf16x3' if special == 'bf16x3' else ''} B={b:5d} Din={i:5d} "
            f"Dout={o:5d} deg={d:3d}: y {errs[0]:.2e}  dx {errs[1]:.2e}  dC {errs[2]:.2e}  y(no grad) "
            f"{errs[3]:.2e}  {'deterministic' if same else 'NOT DETERMINISTIC'}  {'ok' if good else 'FAIL'}")
    for mode in ("lut", "recurrence"):
        for regime in ("fused", "gemm"):
            b, i, o, d = SATURATED
            layer = with_config(ChebyKANLayer(i, o, d, basis_eval=mode).to(DEV), regime=regime)
            x = torch.full((b, i), 12.0, device=DEV)
            x[::2] = -15.0
            x[0, 0] = 1e30
            x.requires_grad_(True)
            y = layer(x)
            dx, dc = torch.autograd.grad(y, [x, layer.cheby_coeffs], torch.randn_like(y))
            fin = bool(torch.isfinite(dx).all() and torch.isfinite(dc).all() and torch.isfinite(y).all())
            ok &= fin
            log(f"  saturated inputs (|x| >= 12), {mode}, {regime}: finite y, dx, dC: {fin}")
    return ok


def variants_for(cfg: tuple[int, int, int, int]) -> list[tuple[str, torch.nn.Module]]:
    _, i, o, d = cfg
    torch.manual_seed(0)
    eager = EagerAcos(i, o, d).to(DEV)
    out: list[tuple[str, torch.nn.Module]] = [("eager acos/cos + einsum", eager)]
    rec = EagerRecurrence(i, o, d).to(DEV)
    rec.load_state_dict(eager.state_dict())
    out.append(("eager recurrence", rec))
    try:
        plain = EagerAcos(i, o, d).to(DEV)
        plain.load_state_dict(eager.state_dict())
        out.append(("torch.compile(eager)", torch.compile(plain)))
    except Exception:
        log("  torch.compile unavailable: " + traceback.format_exc(limit=1))
    out.append(("Triton basis + cuBLAS", TritonCublas(eager).to(DEV)))
    if cfg != LARGE:
        out.append(("floor: autograd.Function, no kernels", Floor(i, o, d).to(DEV)))
    def same_weights(name: str, layer: torch.nn.Module) -> None:
        layer = layer.to(DEV)
        layer.load_state_dict(eager.state_dict())
        out.append((name, layer))

    for name, kw in ((MAIN, {"layout": "kernel"}),
                     ("ncd (recurrence, kernel layout)", {"basis_eval": "recurrence", "layout": "kernel"}),
                     ("ncd (LUT, spec layout: reorder per step)", {"layout": "spec"})):
        same_weights(name, ChebyKANLayer(i, o, d, **kw))
    if cfg == LARGE:
        same_weights("ncd (LUT, matmul=bf16x3)", bf16_layer(i, o, d))
    else:
        same_weights("ncd (LUT, Triton's JIT launch path)", ChebyKANLayer(i, o, d, layout="kernel"))
    return out


def timing() -> tuple[list[tuple], list[tuple]]:
    log("## timing (ms per call, fp32) and launches / GPU time per fwd+bwd step (torch profiler)")
    rows, prof_rows = [], []
    for cfg in CONFIGS:
        b, i, o, _ = cfg
        x = torch.randn(b, i, device=DEV, requires_grad=True)
        g = torch.randn(b, o, device=DEV)
        iters = 10 if cfg == LARGE else 50
        for name, layer in variants_for(cfg):
            fast_env = os.environ.get("NCD_FAST_LAUNCH")
            if "JIT launch" in name:  # the plans' launchers read NCD_FAST_LAUNCH when they are made
                os.environ["NCD_FAST_LAUNCH"] = "0"
                layer._op.module._PLANS.clear()
            t0 = time.time()
            kernels: dict = {}
            try:
                f, bw, fb = measure(layer, x, g, iters)
                n_launch, busy = profile_step(layer, x, g, 3 if cfg == LARGE else 10, kernels)
            except Exception:
                log(f"  {name} failed: {traceback.format_exc(limit=3)}")
                continue
            finally:
                if "JIT launch" in name:
                    os.environ.pop("NCD_FAST_LAUNCH")
                    if fast_env is not None:
                        os.environ["NCD_FAST_LAUNCH"] = fast_env
                    layer._op.module._PLANS.clear()
            rows.append((cfg, name, f, bw, fb))
            prof_rows.append((cfg, name, n_launch, busy))
            log(f"  {cfg} {name:42s} fwd {f:8.4f}  bwd {bw:8.4f}  fwd+bwd {fb:8.4f}  | {n_launch:5.1f} launches, "
                f"GPU busy {busy:7.4f} ms/step   [{time.time() - t0:.1f}s]")
            if name.startswith("ncd"):
                log("      kernels (us/step): " + ", ".join(f"{k[:40]} {v:.1f}" for k, v in sorted(
                    kernels.items(), key=lambda kv: -kv[1])))
                if name == MAIN:
                    launchers = [k for p in layer._op.module._PLANS.values() for k in (
                        *p._fwd.values(), *p._bwd.values(), *p._basis.values(), *getattr(p, "_split", {}).values(),
                        *[getattr(p, a) for a in ("gemm_fwd", "gemm_dc", "dx") if hasattr(p, a)])]
                    names = ", ".join(k.kernel.__name__ + ("" if k.compiled is not None else f" (JIT: {k.why})")
                                      for k in launchers)
                    active = sum(k.compiled is not None for k in launchers)
                    log(f"      direct launches active: {active} of {len(launchers)} "
                        f"kernels ({names})")
    return rows, prof_rows


def sweep() -> list[str]:
    """The GEMM regime at the large config: fwd+bwd ms and errors per (split, BM, BN, BK, warps, stages, KCHUNK)."""
    log("## GEMM-regime sweep at the large config (fwd+bwd ms; ChebyKAN LUT; errors vs float64)")
    b, i, o, d = LARGE
    torch.manual_seed(0)
    x = (torch.randn(b, i, device=DEV) * 2).requires_grad_(True)
    g = torch.randn(b, o, device=DEV)
    out = []
    candidates = {
        "tf32": [((128, 128, 32, 8, 3), 1024), ((128, 128, 32, 8, 3), 1 << 20), ((128, 128, 32, 8, 3), 256),
                 ((128, 128, 32, 4, 3), 1024)],
        "bf16": [((128, 128, 64, 8, 3), 1024), ((128, 128, 64, 8, 3), 1 << 20), ((128, 128, 64, 8, 4), 1024)],
    }
    for split, configs in candidates.items():
        layer = (bf16_layer(i, o, d) if split == "bf16" else ChebyKANLayer(i, o, d)).to(DEV)
        base = layer._op
        xd = x.detach().double().requires_grad_(True)
        cd = layer.cheby_coeffs.detach().double().requires_grad_(True)
        yr = torch.einsum("bid,iod->bo", recurrence_basis(torch.tanh(xd), d), cd)
        dxr, dcr = torch.autograd.grad(yr, [xd, cd], g.double())
        del xd, cd
        for cfg, kchunk in configs:
            with_config(layer, base, gemm_tiles=cfg, gemm_kchunk=kchunk)
            t0 = time.time()
            try:
                y = layer(x)
                dx, dc = torch.autograd.grad(y, [x, layer.cheby_coeffs], g)
                errs = f"y {rel(y, yr):.1e} dx {rel(dx, dxr):.1e} dC {rel(dc, dcr):.1e}"
                del y, dx, dc

                def step() -> None:
                    torch.autograd.grad(layer(x), [x, layer.cheby_coeffs], g)  # noqa: B023

                t = bench(step, 5, 3)
                line = f"  {split} {cfg} KCHUNK {kchunk}: fwd+bwd {t:.3f} ms  {errs}  [{time.time() - t0:.1f}s]"
            except Exception as err:
                line = f"  {split} {cfg} KCHUNK {kchunk}: failed ({type(err).__name__}: {str(err)[:120]})"
            log(line)
            out.append(line)
    return out


def no_grad(layer: torch.nn.Module, x: torch.Tensor) -> None:
    with torch.no_grad():
        layer(x)


def cpu_us(fn, n: int = 100) -> float:
    """Host time per call (us): n back-to-back calls, the GPU queue left to drain afterwards."""
    for _ in range(5):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t = (time.perf_counter() - t0) / n * 1e6
    sync()
    return t


def host_breakdown() -> None:
    """Where the host time of one ncd step goes (recurrence mode, fused regime)."""
    log("## host time per call (us, perf_counter over 100 back-to-back calls; GPU not waited for)")
    for cfg in CONFIGS[:3:2]:
        _host_breakdown(cfg)


def _host_breakdown(cfg: tuple[int, int, int, int]) -> None:
    if True:
        b, i, o, d = cfg
        layer = ChebyKANLayer(i, o, d, basis_eval="recurrence").to(DEV)
        lut = ChebyKANLayer(i, o, d).to(DEV)
        floor = Floor(i, o, d).to(DEV)
        module = layer._op.module
        c = layer.cheby_coeffs
        x = torch.randn(b, i, device=DEV, requires_grad=True)
        xn = x.detach()
        g = torch.randn(b, o, device=DEV)

        def step(m=layer, p=c) -> None:
            torch.autograd.grad(m(x), [x, p], g)

        step()
        step(lut, lut.cheby_coeffs)
        plan = next(iter(module._PLANS.values()))
        stream = module._stream(0)
        ws, cnt = module._buffers(xn, 0, stream, plan.fwd_ws, plan.fwd_cnt)
        y = xn.new_empty((b, o))
        k = plan.fwd(False)
        args = (xn, c, xn, xn, xn, xn, y, ws, cnt, cnt, *plan.fwd_args, 0)
        key = (xn.shape, c.shape, c.stride(), xn.dtype, c.dtype, xn.device, c.device)
        items = [
            ("dict lookup of the route key", lambda: module._ROUTES.get(key)),
            ("x.new_empty", lambda: xn.new_empty((b, o))),
            ("direct launch of the forward kernel", lambda: k(stream, *args)),
            ("Triton JIT launch of the same kernel",
             lambda: module._fwd_fused[k.grid](*args, **k.constexprs, **k.options)),
            ("forward_impl (plan, buffers, alloc, launch)", lambda: module.forward_impl(xn, c, o)),
            ("backward_impl (plan, buffers, 2 allocs, launch)", lambda: module.backward_impl(g, xn, c, o)),
            ("layer(x) under no_grad", lambda: no_grad(layer, x)),
            ("layer(x) with grad (autograd.Function)", lambda: layer(x)),
            ("floor layer(x) with grad (no kernels)", lambda: floor(x)),
            ("floor fwd+bwd step (no kernels)", lambda: step(floor, floor.cheby_coeffs)),
            ("ncd recurrence fwd+bwd step", step),
            ("ncd LUT fwd+bwd step", lambda: step(lut, lut.cheby_coeffs)),
        ]
        log(f"  {cfg}: " + "; ".join(f"{name} {cpu_us(fn):.1f}" for name, fn in items))


def fused_sweep() -> None:
    """Fused-regime variants at the paper configs: GPU busy and step time, errors vs float64."""
    log("## fused-regime tile sweep (fwd BN, fwd BI, bwd BI, bwd BO, warps, stages) / dot precision")
    variants = [None, (64, 32, 32, 64, 8, 3), (64, 32, 64, 64, 4, 3), (64, 32, 32, 64, 4, 2),
                (128, 32, 32, 128, 4, 3)]
    for cfg in CONFIGS[1:3]:
        b, i, o, d = cfg
        torch.manual_seed(0)
        x = (torch.randn(b, i, device=DEV) * 2).requires_grad_(True)
        g = torch.randn(b, o, device=DEV)
        for mode in ("recurrence", "lut"):
            layer = ChebyKANLayer(i, o, d, basis_eval=mode).to(DEV)
            base = layer._op
            xd = x.detach().double().requires_grad_(True)
            cd = layer.cheby_coeffs.detach().double().requires_grad_(True)
            yr = torch.einsum("bid,iod->bo", recurrence_basis(torch.tanh(xd), d), cd)
            dxr, dcr = torch.autograd.grad(yr, [xd, cd], g.double())
            runs = [(v, "tf32x3") for v in (variants if mode == "recurrence" else variants[:1])] + [(None, "bf16x3")]
            for variant, prec in runs:
                module = with_config(layer, base, fused_tiles=variant, fused_precision=prec)._op.module
                try:
                    y = layer(x)
                    dx, dc = torch.autograd.grad(y, [x, layer.cheby_coeffs], g)
                    errs = f"y {rel(y, yr):.1e} dx {rel(dx, dxr):.1e} dC {rel(dc, dcr):.1e}"
                    kernels: dict = {}
                    _, busy = profile_step(layer, x, g, 10, kernels)

                    def step() -> None:
                        torch.autograd.grad(layer(x), [x, layer.cheby_coeffs], g)  # noqa: B023

                    t = bench(step, 50, 3)
                    til = next(iter(module._PLANS.values())).til
                    log(f"  {cfg} {mode:10s} {prec} {variant or 'default'} (fwd {til.fwd_blocks} split "
                        f"{til.fwd_split}, bwd {til.bwd_blocks}): step {t:.4f} ms, GPU {busy:.4f} ms [" + ", ".join(
                            f"{k[:12]} {v:.1f}us" for k, v in kernels.items()) + f"]  {errs}")
                except Exception as err:
                    log(f"  {cfg} {mode} {prec} {variant}: failed ({type(err).__name__}: {str(err)[:160]})")


def training() -> tuple[float, float, float, float]:
    log("## 3-layer ChebyKAN MLP + LayerNorm, synthetic regression, Adam, same init and data")
    torch.manual_seed(0)
    din, hid, steps, batch = 16, 64, 400, 256
    w = torch.randn(din, 4, device=DEV)
    xs = torch.randn(steps, batch, din, device=DEV)
    ys = torch.sin(xs @ w).sum(-1, keepdim=True) + 0.1 * (xs[..., :1] * xs[..., 1:2])

    def mlp(layer_cls, **kw) -> torch.nn.Module:
        return torch.nn.Sequential(layer_cls(din, hid, 8, **kw), torch.nn.LayerNorm(hid), layer_cls(hid, hid, 8, **kw),
                                   torch.nn.LayerNorm(hid), layer_cls(hid, 1, 8, **kw)).to(DEV)

    eager = mlp(EagerAcos)
    ours = mlp(ChebyKANLayer)
    ours.load_state_dict(eager.state_dict())
    results = []
    for model in (eager, ours):
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        losses = []
        t0 = 0.0
        for s in range(steps):
            if s == 100:  # time the last 300 steps (the first compile the kernels)
                sync()
                t0 = time.time()
            loss = torch.nn.functional.mse_loss(model(xs[s]), ys[s])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        sync()
        per_step = (time.time() - t0) / (steps - 100) * 1e3
        final = float(torch.stack(losses[-50:]).mean())
        results += [final, per_step]
    e_loss, e_ms, o_loss, o_ms = results
    log(f"  eager: final loss (mean of last 50 steps) {e_loss:.5f}, {e_ms:.3f} ms/step")
    log(f"  ncd:   final loss (mean of last 50 steps) {o_loss:.5f}, {o_ms:.3f} ms/step "
        f"(relative difference {abs(o_loss - e_loss) / e_loss:.2%})")
    return e_loss, e_ms, o_loss, o_ms


def main() -> int:
    if DEV == "cuda":
        log(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  "
            f"ncd {ncd.__version__}  SMs {torch.cuda.get_device_properties(0).multi_processor_count}")
    t0 = time.time()
    ok = correctness()
    log(f"[correctness {time.time() - t0:.0f}s]")
    rows, prof_rows = timing()
    log(f"[timing done {time.time() - t0:.0f}s]")
    for section in (host_breakdown, fused_sweep, sweep):
        if section is not host_breakdown and ("--no-sweep" in sys.argv or time.time() - t0 > float(
                os.environ.get("SWEEP_BEFORE_S", "200"))):
            break
        try:
            section()
        except Exception:
            log(f"{section.__name__} failed: " + traceback.format_exc(limit=3))
        log(f"[{section.__name__} done {time.time() - t0:.0f}s]")
    train = training()
    log(f"[all done {time.time() - t0:.0f}s]")
    log("")
    log("| config (B, Din, Dout, degree) | variant | fwd ms | bwd ms | fwd+bwd ms | launches/step | GPU ms/step | "
        f"fwd+bwd: {MAIN} speedup vs this |")
    log("|---|---|---:|---:|---:|---:|---:|---:|")
    for cfg in CONFIGS:
        mine = [r for r in rows if r[0] == cfg and r[1] == MAIN]
        for r in (r for r in rows if r[0] == cfg):
            p = next((q for q in prof_rows if q[0] == cfg and q[1] == r[1]), None)
            speed = f"{r[4] / mine[0][4]:.2f}x" if mine else "-"
            log(f"| {cfg} | {r[1]} | {r[2]:.4f} | {r[3]:.4f} | {r[4]:.4f} | "
                f"{p[2]:.0f} | {p[3]:.4f} | {speed} |" if p else f"| {cfg} | {r[1]} | {r[2]:.4f} | {r[3]:.4f} | "
                f"{r[4]:.4f} | - | - | {speed} |")
    for cfg in CONFIGS:
        base = [r for r in rows if r[0] == cfg and not r[1].startswith(("ncd", "floor"))]
        if not base:
            continue
        best = min(base, key=lambda r: r[4])
        for r in (r for r in rows if r[0] == cfg and r[1].startswith("ncd")):
            log(f"best baseline at {cfg}: {best[1]} {best[4]:.4f} ms; {r[1]} {r[4]:.4f} ms; speedup "
                f"{best[4] / r[4]:.2f}x")
    e_loss, e_ms, o_loss, o_ms = train
    log(f"MLP: eager loss {e_loss:.5f} ({e_ms:.2f} ms/step), ncd loss {o_loss:.5f} ({o_ms:.2f} ms/step), "
        f"difference {abs(o_loss - e_loss) / e_loss:.2%}")
    log(f"correctness: {'ok' if ok else 'FAIL'}")
    with open(os.path.join(OUT, "polykan_bench.txt"), "w") as f:
        f.write("\n".join(LINES) + "\n")
    if JSON_PATH and ok:
        from results import new_run, polykan_rows, write_results  # bench/results.py, beside this script

        device = torch.cuda.get_device_name() if DEV == "cuda" else DEV
        write_results(JSON_PATH, new_run("polykan", device, polykan_rows(rows, MAIN, LARGE),
                                         source=f"bench/polykan.py {' '.join(sys.argv[1:])}"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
