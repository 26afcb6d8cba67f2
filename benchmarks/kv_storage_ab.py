# A/B, one process, arms interleaved: the exact int4 target's KV cache stored fp32 (widened to fp64 at every layer) vs
# fp64 (widened once when stored); plain decoding, 64 new tokens after a ~230-token prompt, median of 3, 2 threads.
# The fp32 arm swaps TreeCache.for_model for this script's run only (the engine has no switch for it).
#     python benchmarks/kv_storage_ab.py
import time, torch
from eagle_fsd import cache as cache_mod
from eagle_fsd.model import EaFsdModel
torch.set_grad_enabled(False); torch.set_num_threads(2)
model = EaFsdModel.from_pretrained("qwen2.5-coder-1.5b-instruct", total_token=5, depth=1, top_k=4,
                                   draft_vocab=37888, tune_progress=False)
tok = model.tokenizer
text = "Explain, step by step, how a hash map works, including collisions, resizing and complexity. " * 12
ids = tok(text, return_tensors="pt").input_ids
print("prompt tokens", ids.shape[1])
orig = cache_mod.TreeCache.for_model.__func__
def fp32_storage(cls, model_, max_len):
    return cls(model_.config.num_hidden_layers, max_len, None)
arms = {"fp32 storage": classmethod(fp32_storage), "fp64 storage": classmethod(orig)}
times = {k: [] for k in arms}; outs = {}
for r in range(3):
    for name, fn in arms.items():
        cache_mod.TreeCache.for_model = fn
        t = time.perf_counter()
        out = model.naive_generate(ids, max_new_tokens=64, eos_token_id=[])
        times[name].append(time.perf_counter() - t)
        outs[name] = out
for name in arms:
    print(name, "median s", sorted(times[name])[1], "ms/token", 1000 * sorted(times[name])[1] / 64)
print("same tokens:", torch.equal(outs["fp32 storage"], outs["fp64 storage"]))
