"""The LM drafter: any small causal LM that shares the target's tokenizer (training-free)."""
from __future__ import annotations

from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from eagle_fsd.attention import ATTENTION_NAME, check_attention_support
from eagle_fsd.drafting.base import DraftHead, Drafter
from eagle_fsd.hf import decoder_forward


class LMDrafter(Drafter):
    """Drafts with a small causal LM that shares the target's tokenizer (training-free)."""
    reads_features = False
    auto_quant = True
    is_decoder = True

    def __init__(self, model: nn.Module, vocab_size: int):
        check_attention_support(model.config)
        super().__init__(DraftHead(model, vocab_size))  # cut or padded to the target's logit width
        self.model = model
        self.vocab_size = vocab_size
        self.cache_layers = model.config.num_hidden_layers

    @classmethod
    def load(cls, source, target: nn.Module, tokenizer) -> LMDrafter:
        """The drafter of the causal LM `source` (a directory or hub id, or a loaded model), in the target's dtype and
        device; its tokenizer must be the target's."""
        if isinstance(source, str):
            check_same_tokenizer(tokenizer, AutoTokenizer.from_pretrained(source), source)
            source = AutoModelForCausalLM.from_pretrained(
                source, dtype=target.dtype, attn_implementation=ATTENTION_NAME).to(target.device).eval()
        return cls(source, target.config.vocab_size)

    @property
    def module(self) -> nn.Module:
        return self.model

    @property
    def assistant_model(self) -> nn.Module:
        return self.model

    def _hidden(self, tokens, target_hidden, mask, positions):
        """The LM's final hidden states, its forward as its run plan says (fused where planned: its norms in C++ too,
        since a drafter's rounding moves acceptance only)."""
        return decoder_forward(self.model, tokens, self.cache, mask, positions, self.run), None


def check_same_tokenizer(target_tok, draft_tok, draft_name):
    if target_tok.get_vocab() != draft_tok.get_vocab():
        raise ValueError(f"draft model {draft_name!r} does not share the target's tokenizer "
                         f"({len(draft_tok)} vs {len(target_tok)} tokens, or different ids); an LM drafter must use "
                         "the same tokenizer as the target")
