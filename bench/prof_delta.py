import sys, itertools, torch, torch.nn.functional as F
from torch.profiler import profile, ProfilerActivity
import ncd
from ncd.ops import shipped_spec
from ncd.families.recurrence import kernel_delta as kd
from ncd.families.recurrence.config import LinearScanConfig
from fla.ops.gated_delta_rule import chunk_gated_delta_rule
B, T, H, D = 4, int(sys.argv[1]) if len(sys.argv) > 1 else 16384, 16, 128
gen = torch.Generator(device="cuda").manual_seed(0)
q = torch.randn(B, T, H, D, device="cuda", generator=gen).bfloat16()
k = F.normalize(torch.randn(B, T, H, D, device="cuda", generator=gen), dim=-1).bfloat16()
v = torch.randn(B, T, H, D, device="cuda", generator=gen).bfloat16()
g = F.logsigmoid(torch.randn(B, T, H, device="cuda", generator=gen) + 3)
b = torch.sigmoid(torch.randn(B, T, H, device="cuda", generator=gen))
m = ncd.load(shipped_spec("gated_delta_rule")).module


def kernels(fn, n=5, top=8, show=True):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    rows = {e.key: e.device_time_total / n for e in p.key_averages() if e.device_time_total > 0}
    if show:
        for key, t in sorted(rows.items(), key=lambda kv: -kv[1])[:top]:
            print(f"   {key[:60]:60s} {t:9.1f}")
    return rows


for name, fn in (("ncd", lambda: m.chunk(q, k, v, g, b)), ("fla", lambda: chunk_gated_delta_rule(q, k, v, g, b))):
    print(name, "forward, per call (us):")
    kernels(fn)
cfg = LinearScanConfig()


def fwd():
    return kd.forward(cfg, q, k, v, g, b, None, None, D ** -0.5, 64, False)


def sweep(name, attr, values, kernel):
    default = getattr(kd, attr)
    for value in values:
        setattr(kd, attr, value)
        try:
            r = kernels(fwd, show=False)
            torch.cuda.synchronize()
            print(f"{name} {value}: {r.get(kernel, 0):.0f} us", flush=True)
        except Exception as e:
            print(f"{name} {value}: {type(e).__name__} {str(e)[:80]}", flush=True)
            raise
    setattr(kd, attr, default)


sweep("solve (warps, BK)", "_SOLVE", ((1, 32), (2, 32), (1, 64), (2, 64), (1, 128)), "_solve")
