"""Prepacked bf16 against eagle_fsd.quant int4 over k new tokens: where int4 stops paying (MAX_QUANT_ROWS).
Run before the 4-row limit existed; with it, k > 4 now times the packed path for both.
    python benchmarks/draft_quant_probes/rows_crossover.py
"""
import torch, time, warnings, copy
warnings.filterwarnings("ignore")
torch.set_num_threads(2)
from transformers import AutoModelForCausalLM, DynamicCache
from eagle_fsd import presets
from eagle_fsd.prepack import prepack_linears
from eagle_fsd.quant import quantize_linears
path = presets.resolve_model("qwen2.5-coder-0.5b-instruct")
base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
q = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval(); prepack_linears(q); quantize_linears(q, 4)
prepack_linears(base)
ids = torch.randint(0, 150000, (1, 300))
@torch.no_grad()
def timing(m, n):
    c = DynamicCache(config=m.config); m(ids[:, :200], past_key_values=c)
    best = 1e9
    for _ in range(5):
        t = time.perf_counter(); m(ids[:, 200:200 + n], past_key_values=c); best = min(best, time.perf_counter() - t)
        c.crop(-n)
    return best * 1e3
for n in (1, 4, 5, 6, 8, 12, 100):
    print(n, "packed %.1f int4 %.1f" % (timing(base, n), timing(q, n)), flush=True)
