"""int8 weight-only (bf16 / fp32 activations) against fp32 prepacked on the 0.5B drafter's MLP shape, 8 weights in turn,
with ATen, MKL and oneDNN held to AVX2:
    ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 \
        python benchmarks/draft_quant_probes/int8_avx2_emulated.py
"""
import time, torch
torch.set_num_threads(2)
from eagle_fsd.quant import QuantLinear
from eagle_fsd.prepack import pack_weight, packed_linear
def bench(f, n=20):
    for _ in range(3): f()
    ts=[]
    for _ in range(n):
        t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
    ts.sort(); return ts[len(ts)//2]*1e3
i,o=896,4864
Ws=[torch.randn(o,i) for _ in range(8)]
P=[pack_weight(w) for w in Ws]
Q8=[QuantLinear.from_weight(w, None, 8) for w in Ws]
Q8b=[QuantLinear.from_weight(w.bfloat16(), None, 8) for w in Ws]
for rows in (1,2,4):
    x=torch.randn(rows,i)
    a=bench(lambda: [packed_linear(x,p,None) for p in P])
    b=bench(lambda: [q(x) for q in Q8])
    c=bench(lambda: [q(x.bfloat16()) for q in Q8b])
    print(rows, f"fp32 packed {a:.2f}  int8(fp32 act) {b:.2f}  int8(bf16 act) {c:.2f}", flush=True)
