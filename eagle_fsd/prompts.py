"""Messages -> prompt ids (chat template or FastChat conversation template), and one reply generated under typed
settings: what run, chat and the evaluation harness share."""
from __future__ import annotations

import torch

from eagle_fsd.fsd import FsdConfig
from eagle_fsd.settings import GenerationSettings


class PromptFormat:
    """Messages -> prompt ids through the tokenizer's chat template, or a FastChat conversation template for models
    that have none; also the reply clean-up that goes with the template (FastChat's stop strings)."""

    def __init__(self, tokenizer, conv_template: str | None = None, system: str | None = None):
        self.tokenizer, self.system = tokenizer, system
        self.conv = None
        if conv_template is not None:
            from fastchat.conversation import get_conv_template

            try:
                self.conv = get_conv_template(conv_template)
            except KeyError:
                raise SystemExit(f"--conv-template {conv_template!r} is not a FastChat 0.2.36 template "
                                 "(e.g. vicuna_v1.1, llama-2, qwen-7b-chat)") from None
        elif not tokenizer.chat_template:
            raise SystemExit("the tokenizer has no chat template: pass --conv-template NAME (a FastChat template, "
                             "e.g. vicuna_v1.1)")

    @property
    def stop_token_ids(self) -> list[int]:
        return list(self.conv.stop_token_ids or []) if self.conv is not None else []

    def encode(self, messages: list[dict]) -> torch.Tensor:
        """(1, P) prompt ids for `messages` ([{role: user|assistant, content}]), ready for the assistant's reply."""
        if self.system is not None:
            messages = [{"role": "system", "content": self.system}] + messages
        if self.conv is None:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                      return_dict=True)["input_ids"]
        conv = self.conv.copy()
        for m in messages:
            if m["role"] == "system":
                conv.set_system_message(m["content"])
            else:
                conv.append_message(conv.roles[0 if m["role"] == "user" else 1], m["content"])
        conv.append_message(conv.roles[1], None)
        # A FastChat prompt is plain text: the tokenizer adds its own BOS, as FastChat's gen_model_answer does.
        return self.tokenizer(conv.get_prompt(), return_tensors="pt")["input_ids"]

    def decode(self, new_ids) -> str:
        text = self.tokenizer.decode(new_ids, skip_special_tokens=True)
        stops = self.conv.stop_str if self.conv is not None else None
        for stop in ([stops] if isinstance(stops, str) else stops or []):
            if stop and stop in text:
                text = text[: text.index(stop)]
        return text.strip()


def eos_ids(model, fmt: PromptFormat) -> list[int] | None:
    """The model's eos ids plus the conversation template's stop ids (None: the model's own, unchanged)."""
    extra = fmt.stop_token_ids
    if not extra:
        return None
    eos = model.base_model.generation_config.eos_token_id
    eos = [] if eos is None else (list(eos) if isinstance(eos, (list, tuple)) else [eos])
    return sorted(set(eos) | set(extra))


def generate_reply(model, ids: torch.Tensor, generation: GenerationSettings, fsd: FsdConfig, fmt: PromptFormat,
                   streamer=None, shape=None):
    """One reply: GenerateOutput of speculative decoding (FSD per `fsd`; on the model's tree, or on `shape`, a
    TreeShape), or of plain decoding for the baseline."""
    ids = ids.to(model.base_model.device)
    common = dict(streamer=streamer, eos_token_id=eos_ids(model, fmt), return_dict=True,
                  **generation.sampling_kwargs())
    if generation.baseline:
        return model.naive_generate(ids, **common)
    return model.generate(ids, fsd=fsd, shape=shape, **common)
