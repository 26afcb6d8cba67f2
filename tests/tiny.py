"""Tiny seeded random models for logic tests (no downloads)."""
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

import eagle_fsd.attention  # noqa: F401  (registers the "eagle_fsd" attention function)

# Tiny models run fastest on one thread (and leave the other core to the real-weights tests' setup).
torch.set_num_threads(1)

SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)


def tiny_config(kind="llama", vocab=1000, **overrides):
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[kind]
    return cls(vocab_size=vocab, attn_implementation="eagle_fsd", **{**SIZES, **overrides})


def tiny_model(kind="llama", vocab=1000, seed=0, **overrides):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(kind, vocab, **overrides)).eval()


def hf_greedy(model, ids, n):
    """The target's own greedy continuation through transformers' generate (no eos stop)."""
    return model.generate(ids, do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None,
                          pad_token_id=0)


def assert_speculation_is_plain_greedy(target, drafter, fmt, shape, n: int = 30):
    """Greedy speculation on `target` (its weights in format `fmt`) drafted by `drafter` with tree `shape` equals plain
    greedy decoding of that target (HF generate: prefill, then one row per step), through generate and naive_generate;
    returns generate's output."""
    from eagle_fsd.loading import plan_for
    from eagle_fsd.model import EaFsdModel
    from eagle_fsd.tree.shape import TreeShape

    ids = torch.randint(0, 1000, (1, 10), generator=torch.Generator().manual_seed(3))
    model = EaFsdModel(target, None, drafter, plan=plan_for(target, drafter, TreeShape(*shape), (fmt, None)))
    out = model.generate(ids, max_new_tokens=n, eos_token_id=[], return_dict=True)
    plain = hf_greedy(target, ids, n)
    assert torch.equal(out.sequences, plain)
    assert torch.equal(model.naive_generate(ids, max_new_tokens=n, eos_token_id=[]), plain)
    return out


def machine_clocks(share: float):
    """Clocks (wall, CPU of this process) of a machine on which our threads get `share` of their CPU time
    (1: a quiet machine), for eagle_fsd.tune.trust.TimingWatch."""
    import time

    def clocks():
        wall = time.perf_counter()
        return wall, wall * share * torch.get_num_threads()

    return clocks


class WordTokenizer:
    """Enough of a tokenizer for the tuner's calibration prompts on a tiny model."""
    chat_template = None

    def __call__(self, text, return_tensors="pt"):
        ids = [sum(map(ord, w)) % 1000 for w in text.split()]
        return {"input_ids": torch.tensor([ids])}

    def get_vocab(self):
        return {f"t{i}": i for i in range(1000)}

    def __len__(self):
        return 1000
