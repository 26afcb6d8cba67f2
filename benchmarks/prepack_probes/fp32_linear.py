"""fp32 linear on few rows: MKL (F.linear) against oneDNN with the weight packed once (eagle_fsd.prepack).

Run: python benchmarks/prepack_probes/fp32_linear.py  (add ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2
ONEDNN_MAX_CPU_ISA=AVX2 in front to emulate an AVX2-only CPU). Weights rotate over 128 MB so they come from memory."""
import time, torch, torch.nn.functional as F, sys
torch.set_num_threads(2)
from eagle_fsd.prepack import pack_weight, packed_linear
def bench(f, n=30):
    for _ in range(3): f()
    ts=[]
    for _ in range(n):
        t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
    ts.sort(); return ts[len(ts)//2]*1e3
for (i,o) in [(1536,8960),(8960,1536),(1536,1536),(896,4864)]:
    # rotate over several weights so they come from memory
    Ws=[torch.randn(o,i) for _ in range(max(1, 128*2**20//(o*i*4)))]
    Ps=[pack_weight(w) for w in Ws]
    for rows in [1,2,4,8,24]:
        x=torch.randn(1,rows,i)
        k=[0]
        def mkl():
            k[0]=(k[0]+1)%len(Ws); return F.linear(x,Ws[k[0]])
        def dnn():
            k[0]=(k[0]+1)%len(Ws); return packed_linear(x,Ps[k[0]],None)
        a,b=bench(mkl),bench(dnn)
        err=(F.linear(x,Ws[0])-packed_linear(x,Ps[0],None)).abs().max().item()
        print(f"{i}->{o} rows {rows:2d}: mkl {a:6.2f} ms  onednn packed {b:6.2f} ms  ratio {a/b:4.2f}  maxerr {err:.1e}", flush=True)
