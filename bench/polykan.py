"""GPU benchmark of the polynomial-KAN family (ncd) against eager, torch.compile and Triton + cuBLAS baselines.

Run from outside the repository so that the installed ncd is imported:
    cd /tmp && python3 /path/to/repo/bench/polykan.py
Checks correctness on the GPU first (ncd vs a float64 eager reference), then times every variant side by side
(fp32), then trains a 3-layer ChebyKAN MLP with LayerNorm (eager vs ncd), and prints a table last.
Timing: CUDA events around 50 calls after warm-up, median of 5 repeats, per call (launch overhead included:
these sizes are launch-bound).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import traceback

import torch
import triton
import triton.language as tl

import ncd
from ncd.polykan import ChebyKANLayer, PolyKANLayer

CONFIGS = [(128, 40, 256, 8), (64, 256, 512, 15), (32, 512, 1024, 24), (4096, 1024, 1024, 8)]
DEV = "cuda"
OUT = os.environ.get("OUT", "/tmp")
LINES: list[str] = []


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


def measure(layer: torch.nn.Module, x: torch.Tensor, g: torch.Tensor) -> tuple[float, float, float]:
    params = [p for p in layer.parameters()]

    def fwd() -> None:
        with torch.no_grad():
            layer(x)

    def fwdbwd() -> None:
        y = layer(x)
        torch.autograd.grad(y, [x, *params], g)

    t_fwd = bench(fwd)
    t_fb = bench(fwdbwd)
    try:
        y = layer(x)

        def bwd() -> None:
            torch.autograd.grad(y, [x, *params], g, retain_graph=True)

        t_bwd = bench(bwd)
    except Exception:
        t_bwd = t_fb - t_fwd
    return t_fwd, t_bwd, t_fb


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


# --- sections ---------------------------------------------------------------------------------------------


def correctness() -> bool:
    log("## correctness on the GPU (ncd fp32 vs float64 eager reference; relative L2 errors)")
    ok = True
    cases = [(b, i, o, d, "chebyshev") for (b, i, o, d) in CONFIGS] + [
        (64, 256, 512, 15, "legendre"), (64, 256, 512, 15, "hermite")]
    for b, i, o, d, basis in cases:
        torch.manual_seed(0)
        layer = PolyKANLayer(i, o, d, basis).to(DEV)
        x = (torch.randn(b, i, device=DEV) * 2).requires_grad_(True)
        gy = torch.randn(b, o, device=DEV)
        y = layer(x)
        dx, dc = torch.autograd.grad(y, [x, layer.coefficients], gy)
        xd = x.detach().double().requires_grad_(True)
        cd = layer.coefficients.detach().double().requires_grad_(True)
        yr = torch.einsum("bid,iod->bo", recurrence_basis(torch.tanh(xd), d, basis), cd)
        dxr, dcr = torch.autograd.grad(yr, [xd, cd], gy.double())
        errs = (rel(y, yr), rel(dx, dxr), rel(dc, dcr))
        good = all(e < 1e-4 for e in errs)
        ok &= good
        log(f"  {basis:9s} B={b:5d} Din={i:5d} Dout={o:5d} deg={d:3d}: y {errs[0]:.2e}  dx {errs[1]:.2e}  "
            f"dC {errs[2]:.2e}  {'ok' if good else 'FAIL'}")
    # saturated inputs: finite gradients (eager acos gives NaN there)
    layer = ChebyKANLayer(40, 256, 8).to(DEV)
    x = torch.full((128, 40), 12.0, device=DEV).requires_grad_(True)
    x.data[::2] = -15.0
    y = layer(x)
    dx, dc = torch.autograd.grad(y, [x, layer.cheby_coeffs], torch.randn_like(y))
    fin = bool(torch.isfinite(dx).all() and torch.isfinite(dc).all() and torch.isfinite(y).all())
    ok &= fin
    log(f"  saturated inputs (|x| >= 12): finite y, dx, dC: {fin}")
    return ok


def timing() -> list[tuple]:
    log("## timing (ms per call, fp32)")
    rows = []
    for b, i, o, d in CONFIGS:
        torch.manual_seed(0)
        eager = EagerAcos(i, o, d).to(DEV)
        rec = EagerRecurrence(i, o, d).to(DEV)
        rec.load_state_dict(eager.state_dict())
        ours = ChebyKANLayer(i, o, d).to(DEV)
        ours.load_state_dict(eager.state_dict())
        ours_spec = ChebyKANLayer(i, o, d, layout="spec").to(DEV)
        ours_spec.load_state_dict(eager.state_dict())
        tc = TritonCublas(eager).to(DEV)
        variants: list[tuple[str, torch.nn.Module]] = [
            ("eager acos/cos + einsum", eager), ("eager recurrence", rec)]
        try:
            plain = EagerAcos(i, o, d).to(DEV)
            plain.load_state_dict(eager.state_dict())
            variants.append(("torch.compile(eager)", torch.compile(plain)))
        except Exception:
            log("  torch.compile unavailable: " + traceback.format_exc(limit=1))
        ours_rec = ChebyKANLayer(i, o, d, basis_eval="recurrence").to(DEV)
        ours_rec.load_state_dict(eager.state_dict())
        variants += [("Triton basis + cuBLAS", tc), ("ncd (kernel layout)", ours),
                     ("ncd (spec layout, reorder per step)", ours_spec), ("ncd (recurrence, kernel layout)", ours_rec)]
        x = torch.randn(b, i, device=DEV, requires_grad=True)
        g = torch.randn(b, o, device=DEV)
        for name, layer in variants:
            t0 = time.time()
            try:
                f, bw, fb = measure(layer, x, g)
            except Exception:
                log(f"  {name} failed: {traceback.format_exc(limit=2)}")
                continue
            rows.append(((b, i, o, d), name, f, bw, fb))
            log(f"  ({b}, {i}, {o}, {d}) {name:38s} fwd {f:8.4f}  bwd {bw:8.4f}  fwd+bwd {fb:8.4f}   "
                f"[{time.time() - t0:.1f}s incl. compile]")
    return rows


def launches() -> None:
    log("## kernel launches per call (torch profiler, CUDA kernels)")
    from torch.profiler import ProfilerActivity, profile

    for b, i, o, d in CONFIGS[:3]:
        layer = ChebyKANLayer(i, o, d).to(DEV)
        x = torch.randn(b, i, device=DEV, requires_grad=True)
        layer(x).sum().backward()
        torch.cuda.synchronize()
        g = torch.ones(b, o, device=DEV)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            layer(x)
            torch.cuda.synchronize()
        n_fwd = sum(1 for e in prof.events() if e.device_type.name == "CUDA")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            y = layer(x)
            torch.autograd.grad(y, [x, layer.cheby_coeffs], g)
            torch.cuda.synchronize()
        n_all = sum(1 for e in prof.events() if e.device_type.name == "CUDA")
        log(f"  ({b}, {i}, {o}, {d}): forward {n_fwd} kernels, forward+backward {n_all}")


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
        torch.cuda.synchronize()
        t0 = time.time()
        for s in range(steps):
            loss = torch.nn.functional.mse_loss(model(xs[s]), ys[s])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        torch.cuda.synchronize()
        per_step = (time.time() - t0) / steps * 1e3
        final = float(torch.stack(losses[-50:]).mean())
        results += [final, per_step]
    e_loss, e_ms, o_loss, o_ms = results
    log(f"  eager: final loss (mean of last 50 steps) {e_loss:.5f}, {e_ms:.3f} ms/step")
    log(f"  ncd:   final loss (mean of last 50 steps) {o_loss:.5f}, {o_ms:.3f} ms/step "
        f"(relative difference {abs(o_loss - e_loss) / e_loss:.2%})")
    return e_loss, e_ms, o_loss, o_ms


def main() -> int:
    log(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  "
        f"ncd {ncd.__version__}")
    t0 = time.time()
    ok = correctness()
    log(f"[correctness {time.time() - t0:.0f}s]")
    rows = timing()
    log(f"[timing done {time.time() - t0:.0f}s]")
    try:
        launches()
    except Exception:
        log("launch count failed: " + traceback.format_exc(limit=2))
    train = training()
    log(f"[all done {time.time() - t0:.0f}s]")
    log("")
    log("| config (B, Din, Dout, degree) | variant | fwd ms | bwd ms | fwd+bwd ms | fwd+bwd speedup of ncd vs this |")
    log("|---|---|---:|---:|---:|---:|")
    for cfg in CONFIGS:
        mine = [r for r in rows if r[0] == cfg and r[1] == "ncd (kernel layout)"]
        for r in (r for r in rows if r[0] == cfg):
            speed = f"{r[4] / mine[0][4]:.2f}x" if mine else "-"
            log(f"| {cfg} | {r[1]} | {r[2]:.4f} | {r[3]:.4f} | {r[4]:.4f} | {speed} |")
    for cfg in CONFIGS:
        base = [r for r in rows if r[0] == cfg and not r[1].startswith("ncd")]
        mine = [r for r in rows if r[0] == cfg and r[1] == "ncd (kernel layout)"]
        if base and mine:
            best = min(base, key=lambda r: r[4])
            log(f"best baseline at {cfg}: {best[1]} {best[4]:.4f} ms; ncd {mine[0][4]:.4f} ms; speedup "
                f"{best[4] / mine[0][4]:.2f}x")
    e_loss, e_ms, o_loss, o_ms = train
    log(f"MLP: eager loss {e_loss:.5f} ({e_ms:.2f} ms/step), ncd loss {o_loss:.5f} ({o_ms:.2f} ms/step), "
        f"difference {abs(o_loss - e_loss) / e_loss:.2%}")
    log(f"correctness: {'ok' if ok else 'FAIL'}")
    with open(os.path.join(OUT, "polykan_bench.txt"), "w") as f:
        f.write("\n".join(LINES) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
