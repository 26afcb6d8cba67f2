"""The 0.5B drafter in fp32 against int4 weights (fp32 activations) with ATen, MKL and oneDNN held to AVX2:
    ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 \
        python benchmarks/draft_quant_probes/avx2_emulated.py
"""
import torch, time, warnings
warnings.filterwarnings("ignore")
torch.set_num_threads(2)
print(torch.backends.cpu.get_cpu_capability())
from transformers import AutoModelForCausalLM, DynamicCache
from eagle_fsd import presets
from eagle_fsd.quant import quantize_linears
path = presets.resolve_model("qwen2.5-coder-0.5b-instruct")
base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
q = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(); quantize_linears(q, 4)
ids = torch.randint(0, 150000, (1, 220))
@torch.no_grad()
def timing(m, n):
    c = DynamicCache(config=m.config); m(ids[:, :200], past_key_values=c)
    best = 1e9
    for _ in range(5):
        t = time.perf_counter(); m(ids[:, 200:200 + n], past_key_values=c); best = min(best, time.perf_counter() - t)
        c.crop(-n)
    return best * 1e3
for n in (1, 2, 4):
    print(n, "fp32 %.1f int4(fp32 act) %.1f" % (timing(base, n), timing(q, n)), flush=True)
