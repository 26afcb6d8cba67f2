"""A Llama-family decoder's forward with its elementwise steps as single C++ calls (eagle_fsd.kernels.decoder_glue),
for fp32 models on a CPU: the target and the LM drafter.

A decoding or draft forward holds a few tokens, so on a CPU with low-bit weights its products are cheap (a 0.5B
drafter in int4 reads ~0.3 GB) and what surrounds them is not: transformers' layers spend about a hundred small
operators and several Python wrappers per layer on RMSNorm, the rotary embedding, the gated MLP and the plumbing
between them, a few microseconds each. This forward calls the model's own modules for its products, embedding,
rotary tables and norms, the engine's cache and attention function; per layer

    h = RMSNorm_1(x);  q, k = rope(W_q h), rope(W_k h);  v = W_v h;  x += W_o attention(q, k, v)
    h = RMSNorm_2(x);  x += W_down (silu(W_gate h) * W_up h)

then the final RMSNorm. rope and silu * up round as transformers' operators do, so with `exact` (the norms run by
the model's own modules) the hidden states equal transformers' forward to the bit: the target keeps its greedy
output. Without it (a drafter, whose rounding moves acceptance only) the norms are one C++ call too, summed in
another order. Supported: fp32 Llama and Qwen2 decoders without sliding windows, where the extension builds.
"""
from __future__ import annotations

import torch

from eagle_fsd.attention import ForwardState, eagle_fsd_attention, layer_windows
from eagle_fsd.kernels.decoder_glue import decoder_glue_available, rms_norm, rope, silu_mul

FUSED_MODEL_TYPES = ("llama", "qwen2")


def runs_fused(model) -> bool:
    """The model's layers are the Llama shape this forward runs (pre-norm attention and SiLU-gated MLP, full
    attention, no extra norms), its activations fp32 on a CPU, and the extension builds here."""
    config = model.config
    if config.model_type not in FUSED_MODEL_TYPES or getattr(config, "hidden_act", None) != "silu":
        return False
    norm = model.get_decoder().norm.weight
    if norm.dtype != torch.float32 or norm.device.type != "cpu":
        return False
    return all(window is None for window in layer_windows(config)) and decoder_glue_available()


def fused_decoder_forward(model, input_ids: torch.Tensor, cache, attention_mask: torch.Tensor,
                          positions: torch.Tensor, backend: str = "auto", exact: bool = True) -> torch.Tensor:
    """The final-norm hidden states (n, H) of input_ids (n,) at `positions` (n,), appended to `cache`, under the
    explicit (1, 1, n, cache_len + n) bool mask: eagle_fsd.hf.decoder_forward's contract. exact: equal to it."""
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
