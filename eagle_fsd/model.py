"""EaFsdModel: a target model, a drafter, and the one generation loop (tree drafting -> verification -> acceptance)."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import eagle_fsd.attention  # noqa: F401  (registers the "eagle_fsd" attention function)
from eagle_fsd.attention import ATTENTION_NAME, check_attention_support, check_backend
from eagle_fsd.cache import TreeCache
from eagle_fsd.drafters import EagleDrafter, LMDrafter, grow_tree, load_eagle_head
from eagle_fsd.hf import causal_mask, decoder_forward, prefix_tree_mask
from eagle_fsd.fsd import FsdConfig, node_divergences
from eagle_fsd.sampling import choose_tokens, logits_processor
from eagle_fsd.tree.accept import accept, acceptance_by_depth, fuzzy_choices
from eagle_fsd.tree.dynamic import chain_tree


@dataclass
class GenerateOutput:
    sequences: torch.Tensor                  # (1, prompt + new) token ids, like HF generate
    new_tokens: int = 0
    verify_steps: int = 0                    # target forwards after prefill (one per step)
    accept_lengths: list[int] = field(default_factory=list)  # accepted draft tokens per step (bonus excluded)
    fuzzy_accepts: list[int] = field(default_factory=list)   # of those, accepted only by the FSD rule
    divergences: list[list[float]] = field(default_factory=list)  # per step, D at each visited node with children
    fuzzy_mask: list[bool] = field(default_factory=list)     # per new token: accepted only by the FSD rule
    wall_time: float = 0.0
    plain_steps: int = 0                     # steps decoded without a draft (the speed guard's fallback)
    phase_seconds: dict[str, float] = field(default_factory=dict)  # draft / verify / accept / cache / other

    @property
    def fell_back(self) -> bool:
        """True when some tokens were decoded plainly because speculation did not pay (see SpeedGuard)."""
        return self.plain_steps > 0

    @property
    def tau(self) -> float:
        """Mean tokens per verification forward, bonus token included (SGLang/vLLM/EAGLE convention)."""
        return sum(a + 1 for a in self.accept_lengths) / max(len(self.accept_lengths), 1)

    @property
    def fuzzy_fraction(self) -> float:
        """Share of the accepted draft tokens that only the FSD rule accepted."""
        return sum(self.fuzzy_accepts) / max(sum(self.accept_lengths), 1)

    def acceptance_by_depth(self) -> list[float]:
        """[d-1] = P(a draft token at depth d is accepted | its parent was), over all steps."""
        return acceptance_by_depth(self.accept_lengths)


def eos_token_ids(model, eos_token_id=None) -> set[int]:
    """The stop tokens: `eos_token_id` (an id or a list) if given, else the model's generation config's."""
    eos = model.generation_config.eos_token_id if eos_token_id is None else eos_token_id
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


class PhaseClock:
    """Wall time per phase of the loop: lap(name) charges the time since the previous lap to `name`.
    On CUDA the laps synchronise only when asked to (profiling), so that timing never slows a normal run."""

    def __init__(self, sync: bool = False):
        self.seconds: dict[str, float] = {}
        self.sync = sync and torch.cuda.is_available()
        self.last = time.perf_counter()

    def lap(self, name: str) -> None:
        if self.sync:
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self.last
        self.last = now


class SpeedGuard:
    """Never slower than plain decoding. Each step's target forward is timed, and the cost profile's t_verify(n)
    and t_plain turn that into what plain decoding would cost right now, whatever else loads the machine:
        plain_equivalent(step) = tokens * t_plain * (measured verify time / t_verify(n)).
    When the last `window` speculative steps took `margin` longer than their plain equivalent, the next `backoff`
    tokens are decoded plainly, then speculation is tried again (the backoff doubles each time it loses). The
    window and margin keep a few unlucky steps of a speculation that pays on average from switching it off.
    plain_ms None disables the guard. start_plain: begin in plain mode (the cost model predicts a loss)."""

    def __init__(self, plain_ms: float | None = None, verify_ms: dict[int, float] | None = None, window: int = 16,
                 backoff: int = 32, start_plain: bool = False, margin: float = 0.05):
        self.plain_ms, self.verify_ms = plain_ms, verify_ms or {}
        self.window, self.backoff, self.margin = window, backoff, margin
        self.recent: deque[tuple[float, float]] = deque(maxlen=window)  # (seconds, plain-equivalent seconds)
        self.plain_left = backoff if start_plain and plain_ms is not None else 0

    def speculate(self) -> bool:
        return self.plain_left <= 0

    def _slowdown(self, verify_seconds: float, tree_size: int) -> float:
        """Measured / profiled verification time: how much slower the machine runs now than when tuned."""
        if not self.verify_ms:
            return 1.0
        n = min(self.verify_ms, key=lambda m: (abs(m - tree_size), m))
        return 1000 * verify_seconds / self.verify_ms[n] * (n / tree_size if n > tree_size else 1.0)

    def record(self, speculative: bool, tokens: int, seconds: float, verify_seconds: float = 0.0,
               tree_size: int = 1) -> None:
        if self.plain_ms is None:
            return
        if not speculative:
            self.plain_left -= tokens
            return
        plain_equivalent = tokens * self.plain_ms / 1000 * self._slowdown(verify_seconds, tree_size)
        self.recent.append((seconds, plain_equivalent))
        if (len(self.recent) == self.window
                and sum(s for s, _ in self.recent) > (1 + self.margin) * sum(p for _, p in self.recent)):
            self.plain_left, self.backoff = self.backoff, 2 * self.backoff
            self.recent.clear()


class EaFsdModel(torch.nn.Module):
    """EAGLE-2 dynamic-tree speculative decoding over a Hugging Face causal LM (batch size 1).

    base_model: the HF target model (public, as in EAGLE); tokenizer: its tokenizer; drafter: EagleDrafter or
    LMDrafter (None: plain decoding only).
    """

    def __init__(self, base_model, tokenizer=None, drafter=None, total_token: int = 60, depth: int = 5,
                 top_k: int = 10):
        super().__init__()
        self.base_model = base_model
        self.tokenizer = tokenizer
        self.drafter = drafter
        check_attention_support(base_model.config)  # sliding windows are honoured; other kinds are refused
        self.total_token, self.depth, self.top_k = total_token, depth, top_k
        self._check_tree_args(total_token, depth, top_k)
        self.tuning = None  # a tune.Tuning once the cost model chose the tree (auto settings): plain rate, guard
        # the token vocabulary: logit rows beyond it (padding) are not tokens
        self.vocab_size = len(tokenizer) if tokenizer is not None else base_model.config.vocab_size

    # ---------------------------------------------------------------- loading
    @classmethod
    def from_pretrained(cls, base_model: str, ea_model_path: str | None = None, draft_model=None,
                        total_token: int | str | None = None, depth: int | str | None = None,
                        top_k: int | str | None = None, dtype="auto",
                        device_map=None, attention: str = "auto", tune_progress: bool = True, **kwargs):
        """base_model: a preset name (`eagle-fsd models list`), a hub id or a local directory.
        ea_model_path: an EAGLE-1/2 head (dir or hub id). draft_model: a causal LM sharing the tokenizer (name, dir,
        hub id or a loaded model). Without either, a preset's default drafter is used if it has one (the EAGLE head
        shipped for it, else its sibling LM).
        total_token / depth / top_k: ints (EAGLE's meaning) or "auto": the shape the measured cost model predicts
        fastest on this machine (eagle_fsd.tune; measured once, cached), with plain decoding when nothing pays.
        Unset: "auto" for a preset, else EAGLE's defaults (60, 5, 10).
        dtype "auto": bf16 on CUDA; on CPU bf16 only with native bf16 matmul that measures faster, else fp32."""
        from eagle_fsd import presets
        from eagle_fsd.tune import resolve_dtype

        check_backend(attention)
        preset = base_model in presets.PRESETS
        total_token, depth, top_k = (("auto" if preset else default) if value is None else value
                                     for value, default in ((total_token, 60), (depth, 5), (top_k, 10)))
        auto = [name for name, v in (("total_token", total_token), ("depth", depth), ("top_k", top_k)) if v == "auto"]
        cls._check_tree_args(*(1 if v == "auto" else v for v in (total_token, depth, top_k)))  # fail before loading
        path = presets.resolve_model(base_model)
        if dtype == "auto":
            from transformers import AutoConfig

            dtype = resolve_dtype(dtype, device_map, AutoConfig.from_pretrained(path))
        if ea_model_path is None and draft_model is None:  # the preset's own drafter: a shipped head, else an LM
            ea_model_path = presets.shipped_head(base_model)
            if ea_model_path is None:
                draft_model = presets.default_drafter(base_model)
        load = dict(dtype=dtype, device_map=device_map, attn_implementation=ATTENTION_NAME, **kwargs)
        target = AutoModelForCausalLM.from_pretrained(path, **load).eval()
        target.config.eagle_fsd_attention = attention
        tokenizer = AutoTokenizer.from_pretrained(path)
        drafter = None
        if ea_model_path is not None:
            drafter = EagleDrafter(load_eagle_head(ea_model_path, target), target)
        elif draft_model is not None:
            if isinstance(draft_model, str):
                draft_path = presets.resolve_model(draft_model)
                check_same_tokenizer(tokenizer, AutoTokenizer.from_pretrained(draft_path), draft_model)
                draft_model = AutoModelForCausalLM.from_pretrained(
                    draft_path, dtype=target.dtype, attn_implementation=ATTENTION_NAME).to(target.device).eval()
            draft_model.config.eagle_fsd_attention = attention
            drafter = LMDrafter(draft_model, target.config.vocab_size)
        fixed = [1 if v == "auto" else v for v in (total_token, depth, top_k)]
        model = cls(target, tokenizer, drafter, *fixed)
        if drafter is not None and auto:
            from eagle_fsd.tune import autotune

            autotune(model, base_model, drafter_name=ea_model_path or draft_model, auto=auto,
                     fixed=dict(total_token=total_token, depth=depth, top_k=top_k), progress=tune_progress)
        return model

    def set_tree(self, total_token: int, depth: int, top_k: int) -> None:
        self._check_tree_args(total_token, depth, top_k)
        self.total_token, self.depth, self.top_k = total_token, depth, top_k

    @staticmethod
    def _check_tree_args(total_token, depth, top_k):
        for name, value in (("total_token", total_token), ("depth", depth), ("top_k", top_k)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive int (EAGLE defaults: total_token=60, depth=5, "
                                 "top_k=10)")

    def get_tokenizer(self):
        return self.tokenizer

    # ---------------------------------------------------------------- generation
    @torch.no_grad()
    def generate(self, input_ids, max_new_tokens: int = 512, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, streamer=None, return_dict: bool = False, eos_token_id=None,
                 fsd_threshold: float | None = None, fsd_divergence: str = "kl_qp", fsd_mode: str = "reducible",
                 fsd_distributions: str = "raw", fsd_top_k: int | None = None, fsd: FsdConfig | None = None,
                 profile: bool = False):
        """Speculative decoding. Without FSD (fsd_threshold=None) greedy output is token-for-token the target's own
        greedy output and sampling output follows the target's processed distribution exactly. With a threshold T,
        a draft token is also accepted when Div(target, draft) at its parent is under T (see tree/accept.py); `fsd`
        takes the same settings as one FsdConfig. With tuned (auto) settings a speed guard decodes plainly while
        speculation measures slower than plain decoding (`GenerateOutput.plain_steps`); output is unchanged by it.
        profile: on CUDA, synchronise at each phase so that `phase_seconds` is exact."""
        if self.drafter is None:
            raise ValueError("this EaFsdModel has no drafter: pass ea_model_path= or draft_model= to from_pretrained, "
                             "or use naive_generate for plain decoding")
        if fsd is None:
            fsd = FsdConfig(fsd_threshold, fsd_divergence, fsd_mode, fsd_distributions, fsd_top_k)
        return self._generate(input_ids, self.drafter, max_new_tokens, temperature, top_p, top_k, streamer,
                              return_dict, eos_token_id, fsd, profile)

    @torch.no_grad()
    def naive_generate(self, input_ids, max_new_tokens: int = 512, temperature: float = 0.0, top_p: float = 1.0,
                       top_k: int = 0, streamer=None, return_dict: bool = False, eos_token_id=None):
        """Plain decoding with the target alone (one token per forward): the baseline of every speed figure."""
        return self._generate(input_ids, None, max_new_tokens, temperature, top_p, top_k, streamer, return_dict,
                              eos_token_id)

    # EAGLE's names, so EAGLE users can switch
    def eagenerate(self, input_ids, temperature=0.0, top_p=0.0, top_k=0.0, max_new_tokens=512, max_length=2048,
                   log=False, is_llama3=False):
        return self._eagle_call(self.generate, input_ids, temperature, top_p, top_k, max_new_tokens, max_length, log,
                                is_llama3)

    def naivegenerate(self, input_ids, temperature=0.0, top_p=0.0, top_k=0.0, max_new_tokens=512, max_length=2048,
                      log=False, is_llama3=False):
        return self._eagle_call(self.naive_generate, input_ids, temperature, top_p, top_k, max_new_tokens,
                                max_length, log, is_llama3)

    def _eagle_call(self, fn, input_ids, temperature, top_p, top_k, max_new_tokens, max_length, log, is_llama3):
        # EAGLE: top_p 0 and top_k 0.0 mean "off"; max_length caps prompt + new tokens.
        max_new_tokens = min(max_new_tokens, max_length - input_ids.shape[-1])
        eos = None
        if is_llama3:
            eos = sorted(eos_token_ids(self.base_model) | {self.tokenizer.convert_tokens_to_ids("<|eot_id|>")})
        out = fn(input_ids, max_new_tokens=max_new_tokens, temperature=temperature,
                 top_p=top_p if 0 < top_p < 1 else 1.0, top_k=int(top_k), return_dict=True, eos_token_id=eos)
        return (out.sequences, out.new_tokens, out.verify_steps - 1) if log else out.sequences

    def _check_generate_args(self, input_ids, max_new_tokens):
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"input_ids must have shape (1, prompt_len); got {tuple(input_ids.shape)} "
                             "(batch size > 1 is not supported)")
        if input_ids.shape[1] == 0:
            raise ValueError("input_ids is empty: give at least one prompt token")
        if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a positive int")
        vocab = self.base_model.config.vocab_size
        if self.top_k > vocab:
            raise ValueError(f"top_k={self.top_k} exceeds the vocabulary size {vocab}")
        context = getattr(self.base_model.config, "max_position_embeddings", None)
        needed = input_ids.shape[1] + max_new_tokens
        if context is not None and needed > context:
            raise ValueError(f"prompt ({input_ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) = {needed} "
                             f"exceeds the model's context of {context} tokens; shorten the prompt or lower "
                             "max_new_tokens")

    def _generate(self, input_ids, drafter, max_new_tokens, temperature, top_p, top_k, streamer, return_dict,
                  eos_token_id, fsd: FsdConfig | None = None, profile: bool = False):
        processor = logits_processor(temperature, top_p, top_k)
        self._check_generate_args(input_ids, max_new_tokens)
        start = time.perf_counter()
        model = self.base_model
        device = model.device
        prompt = input_ids[0].to(device)
        eos = eos_token_ids(model, eos_token_id)
        tree_room = self.total_token + 1 if drafter is not None else 1
        cache = TreeCache(model.config.num_hidden_layers, prompt.numel() + max_new_tokens + tree_room)
        if streamer is not None:
            streamer.put(input_ids.cpu())

        # Prefill: the target reads the prompt and chooses the first new token, which roots the first tree.
        n = prompt.numel()
        hidden = decoder_forward(model, prompt, cache, causal_mask(0, n, device), torch.arange(n, device=device))
        root = choose_tokens(model.get_output_embeddings()(hidden[-1:]), processor)[0]
        if drafter is not None:
            drafter.reset(cache.max_len + self.depth * self.top_k)
            root_logits, root_state = drafter.prefill(prompt, root, hidden)

        generated: list[int] = []
        out = GenerateOutput(sequences=input_ids)
        done = self._emit(generated, out.fuzzy_mask, [int(root)], [False], eos, max_new_tokens, streamer)
        guard = self._speed_guard() if drafter is not None else None
        behind: list[tuple[torch.Tensor, torch.Tensor]] = []  # tokens decoded plainly that the drafter has not read
        clock = PhaseClock(sync=profile)
        while not done:
            step_start = clock.last
            speculate = drafter is not None and guard.speculate()
            if speculate and behind:  # back from plain decoding: the drafter reads what it missed, in one forward
                root_logits, root_state = drafter.extend(torch.cat([t for t, _ in behind]),
                                                         torch.cat([h for _, h in behind]))
                behind.clear()
            if speculate:
                tree = grow_tree(drafter, root, root_logits, root_state, self.total_token, self.depth, self.top_k)
            else:
                tree = chain_tree(root.reshape(1))
            clock.lap("draft")
            committed = cache.get_seq_length()
            logits, hidden = self._verify(tree, cache)
            verify_start = clock.last
            clock.lap("verify")
            verify_seconds = clock.last - verify_start
            step = self._accept(tree, logits, processor, fsd)
            clock.lap("accept")
            if step.path_is_prefix:  # the accepted nodes already sit at committed .. committed + a
                cache.crop(committed + step.accept_length + 1)
            else:
                cache.keep(committed, step.path)
            clock.lap("cache")
            out.accept_lengths.append(step.accept_length)
            out.fuzzy_accepts.append(step.fuzzy)
            out.divergences.append(step.divergences)
            out.plain_steps += drafter is not None and not speculate
            done = self._emit(generated, out.fuzzy_mask, step.tokens, step.fuzzy_mask, eos, max_new_tokens, streamer)
            root = step.next_token
            clock.lap("other")
            if not done and drafter is not None:
                new = torch.tensor(step.tokens, device=device)
                if speculate:
                    root_logits, root_state = drafter.extend(new, hidden[step.path])
                else:
                    behind.append((new, hidden[step.path]))
                clock.lap("draft")
            if guard is not None:
                guard.record(speculate, len(step.tokens), clock.last - step_start, verify_seconds, tree.size)
        out.phase_seconds = clock.seconds

        if streamer is not None:
            streamer.end()
        new_ids = torch.tensor([generated], dtype=input_ids.dtype, device=input_ids.device)
        out.sequences = torch.cat([input_ids, new_ids], dim=1)
        out.new_tokens = len(generated)
        out.verify_steps = len(out.accept_lengths)
        out.wall_time = time.perf_counter() - start
        return out if return_dict else out.sequences

    def _speed_guard(self) -> SpeedGuard:
        """The never-slower-than-plain guard: on with tuned settings (it needs the measured plain rate)."""
        if self.tuning is None:
            return SpeedGuard(None)
        t = self.tuning
        if not t.speculate:  # predicted to lose: plain first, speculation re-tried after 128 tokens
            return SpeedGuard(t.plain_ms, t.verify_ms, backoff=128, start_plain=True)
        return SpeedGuard(t.plain_ms, t.verify_ms)

    def _verify(self, tree, cache):
        """All tree nodes in one target forward, node i at position committed + depth(i): (logits, hidden)."""
        committed = cache.get_seq_length()
        hidden = decoder_forward(self.base_model, tree.tokens, cache, prefix_tree_mask(committed, tree.tree_mask),
                                 committed + tree.depths)
        return self.base_model.get_output_embeddings()(hidden), hidden

    def _accept(self, tree, logits, processor, fsd: FsdConfig | None):
        target_choice = choose_tokens(logits, processor)
        if fsd is None or not fsd.active or tree.size == 1:
            return accept(tree, target_choice)
        divergences = node_divergences(tree, logits, fsd, self.vocab_size, processor)
        choice, blocked = fuzzy_choices(tree, target_choice, divergences, fsd.threshold, fsd.mode)
        return accept(tree, choice, blocked, target_choice, divergences)

    @staticmethod
    def _emit(generated: list[int], fuzzy_mask: list[bool], new: list[int], new_fuzzy: list[bool], eos: set[int],
              max_new_tokens: int, streamer) -> bool:
        """Append a step's tokens (and their FSD flags) to `generated` (`fuzzy_mask`), cut at the first eos or at
        the token budget; True when done. A streamer with a `put_fuzzy_mask` method gets the flags before the
        tokens (the chat demo colours fuzzily accepted tokens with them)."""
        kept = []
        for token in new[: max_new_tokens - len(generated)]:
            kept.append(token)
            if token in eos:
                break
        generated.extend(kept)
        fuzzy_mask.extend(new_fuzzy[: len(kept)])
        if streamer is not None and kept:
            if hasattr(streamer, "put_fuzzy_mask"):
                streamer.put_fuzzy_mask(new_fuzzy[: len(kept)])
            streamer.put(torch.tensor(kept))
        return (bool(kept) and kept[-1] in eos) or len(generated) >= max_new_tokens


def check_same_tokenizer(target_tok, draft_tok, draft_name):
    if target_tok.get_vocab() != draft_tok.get_vocab():
        raise ValueError(f"draft model {draft_name!r} does not share the target's tokenizer "
                         f"({len(draft_tok)} vs {len(target_tok)} tokens, or different ids); an LM drafter must use "
                         "the same tokenizer as the target")
