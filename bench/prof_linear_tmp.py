import torch, ncd, torch.nn.functional as F
from ncd.ops import shipped_spec
m = ncd.load(shipped_spec("simple_gla")).module
B,T,H,D = 4,16384,8,128
q = torch.randn(B,T,H,D,device="cuda",dtype=torch.bfloat16); k = q.clone()*0.1; v = torch.randn_like(q)
g = F.logsigmoid(torch.randn(B,T,H,device="cuda")+3)
leaves=[t.requires_grad_() for t in (q,k,v,g)]
for _ in range(3):
    o = m.chunk(*leaves)[0]; o.backward(torch.ones_like(o))
torch.cuda.synchronize()
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as p:
    for _ in range(5):
        with torch.no_grad():
            m.chunk(q,k,v,g)
    torch.cuda.synchronize()
print(p.key_averages().table(sort_by="cuda_time_total", row_limit=14))
with profile(activities=[ProfilerActivity.CUDA]) as p:
    for _ in range(3):
        o = m.chunk(*leaves)[0]; o.backward(torch.ones_like(o))
    torch.cuda.synchronize()
print(p.key_averages().table(sort_by="cuda_time_total", row_limit=14))
