import os, sys, torch, torch.nn.functional as F
from ncd.families.recurrence import kernel_delta as kd
from ncd.families.recurrence.config import LinearScanConfig
torch.manual_seed(0)
dt = torch.float32 if sys.argv[1] == "fp32" else torch.bfloat16
B, T, H, K, V = 2, 300, 2, 128, 128
q = torch.randn(B, T, H, K, device="cuda").to(dt)
k = F.normalize(torch.randn(B, T, H, K, device="cuda"), dim=-1).to(dt)
v = torch.randn(B, T, H, V, device="cuda").to(dt)
g = F.logsigmoid(torch.randn(B, T, H, device="cuda") + 3)
b = torch.sigmoid(torch.randn(B, T, H, device="cuda"))
s0 = torch.randn(B, H, K, V, device="cuda") * 0.1
cfg = LinearScanConfig()
o, sf = kd.forward(cfg, q, k, v, g, b, s0, None, K ** -0.5, 64, True); torch.cuda.synchronize(); print("fwd ok", flush=True)
out = kd.backward(cfg, torch.randn_like(o), torch.randn_like(sf), q, k, v, g, b, s0, None, K ** -0.5, 64); torch.cuda.synchronize(); print("bwd ok", flush=True)
o1, s1 = kd.recurrent(cfg, q, k, v, g, b, s0, K ** -0.5); torch.cuda.synchronize(); print("step ok", (o1.float() - o.float()).abs().max().item(), flush=True)
