"""Top-1 agreement of the 0.5B drafter (bf16, int8, int4) with its fp32 self and with the 1.5B target over the first
400 tokens of README.md (measured on the README of commit bb897a7: `git show bb897a7:README.md > /tmp/R.md` and
point `text` there to repeat it).  python benchmarks/draft_quant_probes/agreement.py
"""
import torch, time, warnings, copy, sys
warnings.filterwarnings("ignore")
torch.set_num_threads(2)
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
from eagle_fsd import presets, quant
from eagle_fsd.prepack import prepack_linears
path = presets.resolve_model("qwen2.5-coder-0.5b-instruct")
tok = AutoTokenizer.from_pretrained(path)
base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
tpath = presets.resolve_model("qwen2.5-coder-1.5b-instruct")
target = AutoModelForCausalLM.from_pretrained(tpath, dtype=torch.bfloat16).eval()
text = open("README.md").read()[:3000]
ids = tok(text, return_tensors="pt").input_ids[:, :400]
with torch.no_grad():
    tgt = target(ids).logits[0].argmax(-1); ref = base(ids).logits[0].argmax(-1)
    bb = copy.deepcopy(base).bfloat16()
    print("bf16: agree fp32 %.3f target %.3f" % ((bb(ids).logits[0].argmax(-1) == ref).float().mean(), (bb(ids).logits[0].argmax(-1) == tgt).float().mean()))
    print("fp32 drafter vs target %.3f" % (ref == tgt).float().mean())
    for bits, g in [(8, 0), (4, quant.INT4_GROUP)]:
        m = copy.deepcopy(base).bfloat16(); quant.quantize_linears(m, bits)
        out = m(ids).logits[0].argmax(-1)
        print(bits, g, "agree fp32 %.3f target %.3f" % ((out == ref).float().mean(), (out == tgt).float().mean()), flush=True)
