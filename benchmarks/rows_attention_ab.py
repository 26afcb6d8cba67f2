"""A/B in one process, arms interleaved: the fused decoder forward with attention over the cache in one C++ call per
layer (fp32, row by row; products called directly; C++ norms for a quantized target: eagle_fsd.fused_decoder now)
against the fused forward of the fifteenth session (transformers' norm modules for the target, every linear layer
called as a module, float64 SDPA over a float64 cache for the quantized target), on the Qwen preset at its
defaults (int4 x int8 target, int4 0.5B drafter), 2 threads, tree pinned to (4, 1, 2) on the 37,888-token draft
vocabulary.

Three prompts twice, each arm first in turn, 128 new tokens: plain decoding and speculative decoding, tokens/s and
τ per arm. The two arms round the quantized target differently (attention sums in another order), so their texts
may part; each arm's speculative output must equal its own plain output.

    python benchmarks/rows_attention_ab.py
"""
import time

import torch

from eagle_fsd import drafters, hf
from eagle_fsd import fused_decoder as fused
from eagle_fsd.attention import ForwardState, eagle_fsd_attention
from eagle_fsd.kernels.decoder_glue import rms_norm, rope, silu_mul
from eagle_fsd.model import EaFsdModel

torch.set_grad_enabled(False)
torch.set_num_threads(2)
ROUNDS = 2
NEW_TOKENS = 128
PROMPTS = ["Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences.",
           "Explain how a hash map handles collisions, briefly.",
           "Write a bash one-liner that counts the lines of every .py file under a folder."]


def previous_forward(model, input_ids, cache, attention_mask, positions, backend="auto", exact=True):
    """eagle_fsd.fused_decoder.fused_decoder_forward as of the fifteenth session (commit 085fa3a)."""
    decoder, config = model.get_decoder(), model.config
    n = input_ids.numel()
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads

    def norm(module, x):
        return module(x) if exact else rms_norm(x, module.weight, module.variance_epsilon)

    x = decoder.embed_tokens(input_ids)
    cos, sin = decoder.rotary_emb(x[None], positions[None])
    cos, sin = cos[0].contiguous(), sin[0].contiguous()
    state = ForwardState(backend)
    for layer in decoder.layers:
        attention, mlp = layer.self_attn, layer.mlp
        h = norm(layer.input_layernorm, x)
        q = rope(attention.q_proj(h), cos, sin, heads)
        k = rope(attention.k_proj(h), cos, sin, kv_heads)
        v = attention.v_proj(h).view(1, n, kv_heads, -1).transpose(1, 2)
        k, v = cache.update(k, v, attention.layer_idx)
        out, _ = eagle_fsd_attention(attention, q, k, v, attention_mask, scaling=attention.scaling,
                                     eagle_fsd_forward=state)
        x = x + attention.o_proj(out.reshape(n, -1))
        h = norm(layer.post_attention_layernorm, x)
        x = x + mlp.down_proj(silu_mul(mlp.gate_proj(h), mlp.up_proj(h)))
    return norm(decoder.norm, x)


CURRENT = fused.fused_decoder_forward, fused.runs_fused
ARMS = {
    # the cache dtype follows fused.runs_fused (TreeCache.for_model): float64 for the previous arm's target
    "previous": (previous_forward, lambda model: False),
    "rows": CURRENT,
}


def use(arm):
    forward, cache_rule = ARMS[arm]
    hf.fused_decoder_forward = drafters.fused_decoder_forward = forward
    fused.runs_fused = cache_rule


def main():
    model = EaFsdModel.from_pretrained("qwen2.5-coder-1.5b-instruct", total_token=4, depth=1, top_k=2,
                                       draft_vocab=37888, tune_progress=False)
    totals = {(arm, kind): [0, 0.0] for arm in ARMS for kind in ("plain", "spec")}
    taus = {arm: [] for arm in ARMS}
    same_as_own_plain = {arm: 0 for arm in ARMS}
    order = list(ARMS)
    runs = 0
    for _ in range(ROUNDS):
        for prompt in PROMPTS:
            ids = model.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                      add_generation_prompt=True, return_tensors="pt")
            ids = ids if torch.is_tensor(ids) else ids["input_ids"]
            for arm in order:
                use(arm)
                start = time.perf_counter()
                plain = model.naive_generate(ids, max_new_tokens=NEW_TOKENS, return_dict=True)
                plain_s = time.perf_counter() - start
                start = time.perf_counter()
                spec = model.generate(ids, max_new_tokens=NEW_TOKENS, return_dict=True)
                spec_s = time.perf_counter() - start
                new = spec.sequences.shape[1] - ids.shape[1]
                totals[arm, "plain"][0] += plain.sequences.shape[1] - ids.shape[1]
                totals[arm, "plain"][1] += plain_s
                totals[arm, "spec"][0] += new
                totals[arm, "spec"][1] += spec_s
                taus[arm].append(spec.tau)
                same_as_own_plain[arm] += int(torch.equal(spec.sequences, plain.sequences))
            order.reverse()
            runs += 1
    use("rows")
    for arm in ARMS:
        plain_rate = totals[arm, "plain"][0] / totals[arm, "plain"][1]
        spec_rate = totals[arm, "spec"][0] / totals[arm, "spec"][1]
        print(f"{arm:9s} plain {plain_rate:5.2f} tok/s  speculative {spec_rate:5.2f} tok/s  "
              f"tau {sum(taus[arm]) / len(taus[arm]):.2f}  speculative = own plain on {same_as_own_plain[arm]}/{runs}")
    for kind in ("plain", "spec"):
        rates = {arm: totals[arm, kind][0] / totals[arm, kind][1] for arm in ARMS}
        print(f"{kind}: rows / previous = {rates['rows'] / rates['previous']:.2f}x")


if __name__ == "__main__":
    main()
