"""Building a drafter for a loaded target: an EAGLE-1/2 head, an EAGLE-3 head (any of the three published layouts,
told apart by config.json) or a causal LM that shares the target's tokenizer."""
from __future__ import annotations

import json

from transformers import AutoModelForCausalLM, AutoTokenizer

from eagle_fsd.attention import ATTENTION_NAME
from eagle_fsd.drafters import EagleDrafter, LMDrafter, _head_file, load_eagle_head
from eagle_fsd.eagle3 import Eagle3Drafter, is_eagle3, load_eagle3_head


def head_is_eagle3(path: str) -> bool:
    """Whether the head at `path` (directory or hub id) is an EAGLE-3 head, from its config.json."""
    config_file = _head_file(path, "config.json")
    if config_file is None:
        raise FileNotFoundError(f"EAGLE head {path!r} has no config.json")
    with open(config_file) as f:
        return is_eagle3(json.load(f))


def check_same_tokenizer(target_tok, draft_tok, draft_name):
    if target_tok.get_vocab() != draft_tok.get_vocab():
        raise ValueError(f"draft model {draft_name!r} does not share the target's tokenizer "
                         f"({len(draft_tok)} vs {len(target_tok)} tokens, or different ids); an LM drafter must use "
                         "the same tokenizer as the target")


def load_drafter(target, tokenizer, ea_model_path: str | None, draft_model, attention: str = "auto",
                 resolve=lambda name: name):
    """The drafter for `target`: from an EAGLE head (ea_model_path: EAGLE-1/2 or EAGLE-3, a directory or hub id),
    else from draft_model (a name `resolve` turns into a directory or hub id, or a loaded model), else None."""
    if ea_model_path is not None:
        if head_is_eagle3(ea_model_path):  # a missing directory or config.json is reported here, by name
            head, layers = load_eagle3_head(ea_model_path, target)
            return Eagle3Drafter(head, target, layers, attention)
        return EagleDrafter(load_eagle_head(ea_model_path, target), target, attention)
    if draft_model is None:
        return None
    if isinstance(draft_model, str):
        draft_path = resolve(draft_model)
        check_same_tokenizer(tokenizer, AutoTokenizer.from_pretrained(draft_path), draft_model)
        draft_model = AutoModelForCausalLM.from_pretrained(
            draft_path, dtype=target.dtype, attn_implementation=ATTENTION_NAME).to(target.device).eval()
    return LMDrafter(draft_model, target.config.vocab_size, attention)
