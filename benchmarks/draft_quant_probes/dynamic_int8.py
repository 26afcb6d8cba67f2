"""fbgemm dynamic int8 (activations quantized too) against fp32 / prepacked bf16 drafter: timing and top-1
agreement with the fp32 drafter (BENCHMARKS: dropped, 0.79-0.81).  python benchmarks/draft_quant_probes/dynamic_int8.py
"""
import torch, time, warnings, copy
warnings.filterwarnings("ignore")
torch.set_num_threads(2)
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
from eagle_fsd import presets
from eagle_fsd.prepack import prepack_linears
import torch.ao.quantization as Q
path = presets.resolve_model("qwen2.5-coder-0.5b-instruct")
tok = AutoTokenizer.from_pretrained(path)
base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
mb = copy.deepcopy(base).to(torch.bfloat16); prepack_linears(mb)
mq = copy.deepcopy(base)
mq = Q.quantize_dynamic(mq, {torch.nn.Linear}, dtype=torch.qint8)  # default: per-tensor weights
mqc = Q.quantize_dynamic(copy.deepcopy(base), {torch.nn.Linear: Q.per_channel_dynamic_qconfig})
text = "Write a persuasive essay to convince your friend to try a new hobby. Explain why reading books every day helps children learn about the world, and give three examples." * 3
ids = tok(text, return_tensors="pt").input_ids[:, :200]
@torch.no_grad()
def timing(m, n):
    c = DynamicCache(config=m.config); m(ids, past_key_values=c)
    best = 1e9
    for _ in range(5):
        t = time.perf_counter(); m(ids[:, :n] , past_key_values=c); best = min(best, time.perf_counter() - t)
        c.crop(-n)
    return best * 1e3
for name, m in [("fp32", base), ("bf16 packed", mb), ("int8 dyn", mq), ("int8 dyn perchan", mqc)]:
    print(name, [round(timing(m, n), 1) for n in (1, 2, 4)], flush=True)
with torch.no_grad():
    ref = base(ids).logits[0].argmax(-1)
    for name, m in [("bf16 packed", mb), ("int8 dyn", mq), ("int8 dyn perchan", mqc)]:
        print(name, "top1 agreement with fp32", (m(ids).logits[0].argmax(-1) == ref).float().mean().item())
