"""The tests' model pair: real SmolLM2-135M-Instruct as the target, a perturbed copy of it as the draft model."""
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

from eagle_fsd.files import cache_dir


def target_dir() -> str:
    path = os.path.join(cache_dir(), "models", "smollm2-135m-instruct")
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        raise FileNotFoundError(f"{path} is missing: run `eagle-fsd models fetch smollm2-135m-instruct` (README "
                                "setup)")
    return path


def perturbed_copy(source: str, out: str, spread: float = 0.08, seed: int = 0) -> str:
    """`source` with Gaussian noise (`spread` of each matrix's standard deviation) on every matrix but the
    embeddings: a drafter that agrees with the target often, not always."""
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(source):
        if name != "model.safetensors" and os.path.isfile(os.path.join(source, name)):
            shutil.copy(os.path.join(source, name), out)
    state = load_file(os.path.join(source, "model.safetensors"))
    generator = torch.Generator().manual_seed(seed)
    for key, value in state.items():
        if value.ndim == 2 and "embed" not in key:
            noise = torch.randn(value.shape, generator=generator) * spread * value.float().std()
            state[key] = (value.float() + noise).to(value.dtype)
    save_file(state, os.path.join(out, "model.safetensors"))
    return out


def counters(llm) -> tuple[int, int]:
    """vLLM's running totals: verification steps with drafts, and drafts accepted."""
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    return metrics["vllm:spec_decode_num_drafts"], metrics["vllm:spec_decode_num_accepted_tokens"]


def generate(llm, prompts, params):
    """Token ids per prompt and the mean number of drafts accepted per verification step in this call."""
    drafts0, accepted0 = counters(llm)
    outputs = llm.generate(prompts, params)
    drafts1, accepted1 = counters(llm)
    return [list(o.outputs[0].token_ids) for o in outputs], (accepted1 - accepted0) / max(drafts1 - drafts0, 1)
