"""The 0.5B drafter's forward over k = 1, 2, 4, 8 new tokens on a 200-token cache: prepacked bf16, weight-only int8,
int4 with groups of 64 and 128 (one-off layers written before eagle_fsd.quant).
    python benchmarks/draft_quant_probes/weight_only_timing.py
"""
import torch, time, warnings, copy, sys
warnings.filterwarnings("ignore")
torch.set_num_threads(2)
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
from eagle_fsd import presets
from eagle_fsd.prepack import prepack_linears
path = presets.resolve_model("qwen2.5-coder-0.5b-instruct")
tok = AutoTokenizer.from_pretrained(path)
base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
class Int8WO(torch.nn.Module):
    def __init__(self, lin):
        super().__init__()
        w = lin.weight.detach().float()
        s = w.abs().amax(1).clamp(min=1e-8) / 127
        self.q = (w / s[:, None]).round().clamp(-127, 127).to(torch.int8); self.s = s.bfloat16()
        self.bias = None if lin.bias is None else lin.bias.detach().bfloat16()
        self.i, self.o = lin.in_features, lin.out_features
    def forward(self, x):
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, self.i), self.q, self.s).reshape(*x.shape[:-1], self.o)
        return y if self.bias is None else y + self.bias
class Int4WO(torch.nn.Module):
    def __init__(self, lin, g):
        super().__init__()
        w = lin.weight.detach().float(); n, k = w.shape; wg = w.reshape(n, k // g, g)
        mn, mx = wg.amin(-1), wg.amax(-1); scale = (mx - mn).clamp(min=1e-6) / 15; zero = mn + 8 * scale
        q = ((wg - mn[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).reshape(n, k)
        self.p = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
        self.sz = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().bfloat16(); self.g = g
        self.bias = None if lin.bias is None else lin.bias.detach().bfloat16()
        self.i, self.o = k, n
    def forward(self, x):
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, self.i), self.p, self.g, self.sz).reshape(*x.shape[:-1], self.o)
        return y if self.bias is None else y + self.bias
def swap(m, make):
    m = copy.deepcopy(m).to(torch.bfloat16)
    for mod in list(m.modules()):
        for cname, child in list(mod.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(mod, cname, make(child))
    return m
mb = copy.deepcopy(base).to(torch.bfloat16); prepack_linears(mb)
variants = [("bf16 packed", mb), ("int8 wo", swap(base, Int8WO)), ("int4 g64", swap(base, lambda l: Int4WO(l, 64))), ("int4 g128", swap(base, lambda l: Int4WO(l, 128)))]
text = "Write a persuasive essay to convince your friend to try a new hobby. Explain why reading books every day helps children learn about the world, and give three examples." * 3
ids = tok(text, return_tensors="pt").input_ids[:, :200]
@torch.no_grad()
def timing(m, n):
    c = DynamicCache(config=m.config); m(ids, past_key_values=c)
    best = 1e9
    for _ in range(7):
        t = time.perf_counter(); m(ids[:, :n] , past_key_values=c); best = min(best, time.perf_counter() - t)
        c.crop(-n)
    return best * 1e3
with torch.no_grad():
    ref = base(ids).logits[0].argmax(-1)
for name, m in variants:
    with torch.no_grad():
        agree = (m(ids).logits[0].argmax(-1) == ref).float().mean().item()
    print(name, [round(timing(m, n), 1) for n in (1, 2, 4, 8)], "agree %.3f" % agree, flush=True)
