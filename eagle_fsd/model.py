"""EaFsdModel: a target model, a drafter, and the one generation loop (tree drafting -> verification -> acceptance)."""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

import eagle_fsd.attention  # noqa: F401  (registers the "eagle_fsd" attention function)
from eagle_fsd import loading, vocab
from eagle_fsd.attention import check_attention_support, check_backend
from eagle_fsd.cache import TreeCache
from eagle_fsd.drafters import grow_tree
from eagle_fsd.dtypes import dtype_name
from eagle_fsd.hf import causal_mask, decoder_outputs, prefix_tree_mask
from eagle_fsd.fsd import FsdConfig, fsd_accept, resolve_fsd
from eagle_fsd.guard import GuardMemory, PhaseClock, SpeedGuard
from eagle_fsd.sampling import choose_tokens, logits_processor
from eagle_fsd.tree.accept import Step, acceptance_by_depth, tokens_per_step
from eagle_fsd.tree.dynamic import chain_tree
from eagle_fsd.tree.shape import TreeShape
from eagle_fsd.settings import Settings
from eagle_fsd.tune import Tuning


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
        return tokens_per_step(sum(self.accept_lengths), len(self.accept_lengths))

    @property
    def fuzzy_fraction(self) -> float:
        """Share of the accepted draft tokens that only the FSD rule accepted."""
        return sum(self.fuzzy_accepts) / max(sum(self.accept_lengths), 1)

    def acceptance_by_depth(self) -> list[float]:
        """[d-1] = P(a draft token at depth d is accepted | its parent was), over all steps."""
        return acceptance_by_depth(self.accept_lengths)

    def record(self, step: Step, plain: bool) -> None:
        """Add one verification step's statistics (its tokens go through EaFsdModel._emit)."""
        self.accept_lengths.append(step.accept_length)
        self.fuzzy_accepts.append(step.fuzzy)
        self.divergences.append(step.divergences)
        self.plain_steps += plain

    def finish(self, input_ids: torch.Tensor, generated: list[int], seconds: float, phase_seconds: dict) -> None:
        new_ids = torch.tensor([generated], dtype=input_ids.dtype, device=input_ids.device)
        self.sequences = torch.cat([input_ids, new_ids], dim=1)
        self.new_tokens, self.verify_steps = len(generated), len(self.accept_lengths)
        self.wall_time, self.phase_seconds = seconds, phase_seconds


class DrafterReader:
    """Where the drafter has read up to: its logits and state at the current root, and what it has not read yet:
    the prompt until the first draft (a call the speed guard decodes plainly throughout never runs the drafter), and
    the tokens decoded plainly since, with the target's hidden states (the guard skips drafting for a while)."""

    def __init__(self, drafter, max_len: int, prompt: torch.Tensor, root: torch.Tensor, hidden: torch.Tensor):
        self.drafter = drafter
        drafter.reset(max_len)
        self.unread_prompt: tuple | None = (prompt, root, hidden)
        self.root_logits = self.root_state = None
        self.behind: list[tuple[torch.Tensor, torch.Tensor]] = []

    def read_prompt(self) -> bool:
        """Read the prompt if not yet read (the first draft's prefill); True when it did."""
        if self.unread_prompt is None:
            return False
        self.root_logits, self.root_state = self.drafter.prefill(*self.unread_prompt)
        self.unread_prompt = None
        return True

    def at_root(self):
        """(logits, state) at the root; on the first draft the drafter reads the prompt, and back from plain decoding
        what it missed, in one forward."""
        self.read_prompt()
        if self.behind:
            self.root_logits, self.root_state = self.drafter.extend(torch.cat([t for t, _ in self.behind]),
                                                                    torch.cat([h for _, h in self.behind]))
            self.behind.clear()
        return self.root_logits, self.root_state

    def read(self, tokens: torch.Tensor, hidden: torch.Tensor, speculated: bool,
             level_slots: torch.Tensor | None = None) -> None:
        """The step's emitted tokens and their target hidden states: read now, or queued for the next draft.
        level_slots: per accepted draft token, its entry in the drafter's tree scratch (-1: never forwarded); a
        drafter that reads no features keeps the leading forwarded ones and reads only the rest."""
        if speculated:
            kept = 0
            if level_slots is not None and not self.drafter.reads_features:
                kept = int((level_slots >= 0).cumprod(0).sum())
                self.drafter.keep_levels(level_slots[:kept])
            self.root_logits, self.root_state = self.drafter.extend(tokens[kept:], hidden[kept:])
        else:
            self.behind.append((tokens, hidden))


def exactness(dtype: torch.dtype, target_quantized: bool = False) -> str:
    """What lossless greedy speculation guarantees in `dtype`: in fp32 the target's own greedy tokens; in a 16-bit
    dtype the target's greedy choice computed by forwards over several tokens, whose rounding depends on how many
    tokens a forward holds (measured agreement with plain decoding: README, BENCHMARKS.md). A quantized target
    (eagle_fsd.target_quant) is the model it is exact against."""
    if target_quantized:
        return ("greedy output is plain greedy decoding of the quantized target (int8 weights rounded from the "
                "preset's, or int4 where they are 4-bit already; 8-bit activations per row, fp32 elsewhere), token "
                "for token; --target-quant off keeps the float weights")
    if dtype in (torch.float32, torch.float64):
        return "greedy output is the target's own greedy output, token for token"
    name = dtype_name(dtype)
    return (f"in {name} each greedy token is the target's top choice after the same prefix, but the target scores "
            f"a step's tokens in one forward and {name} rounds differently with the number of tokens scored, so a "
            "near-tied choice can flip against one-token-at-a-time decoding and the text part from there "
            "(`eagle-fsd bench` counts the outputs identical to plain decoding); --dtype fp32 gives the target's "
            "exact greedy output")


def eos_token_ids(model, eos_token_id=None) -> set[int]:
    """The stop tokens: `eos_token_id` (an id or a list) if given, else the model's generation config's."""
    eos = model.generation_config.eos_token_id if eos_token_id is None else eos_token_id
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


class EaFsdModel(torch.nn.Module):
    """EAGLE-2 dynamic-tree speculative decoding over a Hugging Face causal LM (batch size 1).

    base_model: the HF target model (public, as in EAGLE); tokenizer: its tokenizer; drafter: EagleDrafter,
    Eagle3Drafter or LMDrafter (None: plain decoding only; eagle_fsd.loading builds one). The draft tree: EAGLE's
    total_token / depth / top_k, or `shape` (a TreeShape, which wins); `tuning`: the cost model's choice that
    chose it (eagle_fsd.tune), which turns the speed guard on. Both are fixed for the model's life: `generate`
    takes another shape per call.
    """

    def __init__(self, base_model, tokenizer=None, drafter=None, total_token: int = 60, depth: int = 5,
                 top_k: int = 10, attention: str = "auto", shape: TreeShape | None = None,
                 tuning: Tuning | None = None):
        super().__init__()
        check_backend(attention)
        self.attention = attention  # the target's attention backend (eagle_fsd.attention); drafters hold their own
        self.base_model = base_model
        self.tokenizer = tokenizer
        self.drafter = drafter
        check_attention_support(base_model.config)  # sliding windows are honoured; other kinds are refused
        self._shape = shape or TreeShape(total_token, depth, top_k)
        self._tuning = tuning  # plain rate and verify costs for the speed guard
        self._guards: dict[FsdConfig | None, SpeedGuard] = {}  # the speed guard per acceptance rule, for life
        self._guard_memory = GuardMemory()  # what the guards measured, shared by them
        # the token vocabulary: logit rows beyond it (padding) are not tokens
        self.vocab_size = len(tokenizer) if tokenizer is not None else base_model.config.vocab_size
        self._vocab_ids = {0: None}  # draft vocabulary size -> its target ids (0: the drafter's own)
        if drafter is not None and self._shape.draft_vocab:
            drafter.set_draft_vocab(self._draft_vocab_ids(self._shape.draft_vocab))

    @property
    def shape(self) -> TreeShape:
        return self._shape

    @property
    def tuning(self) -> Tuning | None:
        return self._tuning

    # EAGLE's names for the tree
    total_token = property(lambda self: self._shape.total_token)
    depth = property(lambda self: self._shape.depth)
    top_k = property(lambda self: self._shape.branching)

    # ---------------------------------------------------------------- loading
    @classmethod
    def from_pretrained(cls, base_model: str, ea_model_path: str | None = None, draft_model=None,
                        total_token: int | str | None = None, depth: int | str | None = None,
                        top_k: int | str | None = None, dtype="auto", device_map=None, attention: str = "auto",
                        tune_progress: bool = True, prepack="auto", draft_quant="auto", target_quant="auto",
                        draft_vocab: int | str | None = None, **kwargs):
        """base_model: a preset name (`eagle-fsd models list`), a hub id or a local directory; ea_model_path: an
        EAGLE-1/2 or EAGLE-3 head, or draft_model: a causal LM sharing the tokenizer (default: the preset's drafter).
        total_token / depth / top_k: ints (EAGLE's meaning) or "auto", the shape the measured cost model predicts
        fastest here (unset: "auto" for a preset, else EAGLE's 60, 5, 10); draft_vocab: the drafter scores the N
        most frequent tokens (0: all; unset: "auto" while the tree is). dtype, prepack, draft_quant, target_quant:
        "auto" or forced; see eagle_fsd.loading.load_pretrained."""
        return loading.load_pretrained(cls, base_model, ea_model_path, draft_model,
                                       (total_token, depth, top_k, draft_vocab),
                                       dtype=dtype, device_map=device_map, attention=attention,
                                       tune_progress=tune_progress, prepack=prepack, draft_quant=draft_quant,
                                       target_quant=target_quant, **kwargs)

    def _draft_vocab_ids(self, size: int) -> torch.Tensor | None:
        """The target ids of the `size` most frequent tokens (eagle_fsd.vocab); 0: None, the drafter's own."""
        if size not in self._vocab_ids:
            order = vocab.frequency_order(self.tokenizer)
            if order is None:
                raise ValueError(f"draft_vocab={size}: no frequency table for this tokenizer (eagle_fsd.vocab)")
            self._vocab_ids[size] = vocab.draft_vocab(order, size).to(self.base_model.device)
        return self._vocab_ids[size]

    def get_tokenizer(self):
        return self.tokenizer

    # ---------------------------------------------------------------- generation
    @torch.no_grad()
    def generate(self, input_ids, max_new_tokens: int = 512, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, streamer=None, return_dict: bool = False, eos_token_id=None,
                 fsd_threshold: float | None = None, fsd: FsdConfig | None = None, profile: bool = False,
                 shape: TreeShape | None = None):
        """Speculative decoding. Without FSD (fsd=None, fsd_threshold=None) greedy output is token-for-token the
        target's own greedy output and sampling output follows the target's processed distribution exactly. With
        fsd=FsdConfig(threshold=T, ...), a draft token is also accepted when Div(target, draft) at its parent is under
        T (see eagle_fsd/fsd.py); fsd_threshold=T is short for fsd=FsdConfig(threshold=T) (pass one or the other).
        With tuned (auto) settings a speed guard decodes plainly while speculation measures slower than plain
        decoding (`GenerateOutput.plain_steps`); output is unchanged by it.
        profile: on CUDA, synchronise at each phase so that `phase_seconds` is exact.
        shape: the draft tree of this call, as given (no speed guard); None: the model's own."""
        if self.drafter is None:
            raise ValueError("this EaFsdModel has no drafter: pass ea_model_path= or draft_model= to from_pretrained, "
                             "or use naive_generate for plain decoding")
        fsd = resolve_fsd(fsd, fsd_threshold)
        with self._drafting_for(shape):
            return self._generate(input_ids, self.drafter, max_new_tokens, temperature, top_p, top_k, streamer,
                                  return_dict, eos_token_id, fsd, profile, shape)

    def _drafting_for(self, shape: TreeShape | None):
        """The drafter over `shape`'s draft vocabulary for one call, when it is not the model's own."""
        if shape is None or shape.draft_vocab == self._shape.draft_vocab:
            return nullcontext()
        return self.drafter.drafting_over(self._draft_vocab_ids(shape.draft_vocab))

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

    def _check_generate_args(self, input_ids, max_new_tokens, shape: TreeShape):
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"input_ids must have shape (1, prompt_len); got {tuple(input_ids.shape)} "
                             "(batch size > 1 is not supported)")
        if input_ids.shape[1] == 0:
            raise ValueError("input_ids is empty: give at least one prompt token")
        if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a positive int")
        vocab = self.base_model.config.vocab_size
        if shape.branching > vocab:
            raise ValueError(f"tree branching (EAGLE's top_k) {shape.branching} exceeds the vocabulary size {vocab}")
        context = getattr(self.base_model.config, "max_position_embeddings", None)
        needed = input_ids.shape[1] + max_new_tokens
        if context is not None and needed > context:
            raise ValueError(f"prompt ({input_ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) = {needed} "
                             f"exceeds the model's context of {context} tokens; shorten the prompt or lower "
                             "max_new_tokens")

    def _generate(self, input_ids, drafter, max_new_tokens, temperature, top_p, top_k, streamer, return_dict,
                  eos_token_id, fsd: FsdConfig | None = None, profile: bool = False, shape: TreeShape | None = None):
        """The loop; with `shape` (not the model's own) the tree is run as given, without the speed guard."""
        processor = logits_processor(temperature, top_p, top_k)
        tree_shape = shape or self._shape
        self._check_generate_args(input_ids, max_new_tokens, tree_shape)
        start = time.perf_counter()
        prompt = input_ids[0].to(self.base_model.device)
        eos = eos_token_ids(self.base_model, eos_token_id)
        tree_room = tree_shape.total_token + 1 if drafter is not None else 1
        cache = TreeCache.for_model(self.base_model, prompt.numel() + max_new_tokens + tree_room)
        if streamer is not None:
            streamer.put(input_ids.cpu())

        # Prefill: the target reads the prompt and chooses the first new token, which roots the first tree.
        n = prompt.numel()
        layers = None if drafter is None else drafter.feature_layers  # EAGLE-3: hidden states entering these layers
        hidden, features = decoder_outputs(self.base_model, prompt, cache, causal_mask(0, n, prompt.device),
                                           torch.arange(n, device=prompt.device), self.attention, layers)
        root = choose_tokens(self.base_model.get_output_embeddings()(hidden[-1:]), processor)[0]
        reader = None
        if drafter is not None:
            reader = DrafterReader(drafter, cache.max_len + tree_shape.level_room, prompt, root, features)

        generated: list[int] = []
        out = GenerateOutput(sequences=input_ids)
        done = self._emit(generated, out.fuzzy_mask, [int(root)], [False], eos, max_new_tokens, streamer)
        guard = None if drafter is None else self._speed_guard(fsd) if shape is None else SpeedGuard(None)
        clock = PhaseClock(sync=profile)
        while not done:
            speculate = drafter is not None and guard.speculate()
            if speculate and reader.read_prompt():
                clock.lap("draft_prefill")  # once a call, like the target's prefill: not a step's cost
            step_start = clock.last
            tree = self._draft(reader, root, tree_shape) if speculate else chain_tree(root.reshape(1))
            clock.lap("draft")
            step, features, verify_seconds = self._verify_and_accept(tree, cache, processor, fsd, clock, layers,
                                                                     emitted=len(generated))
            out.record(step, plain=drafter is not None and not speculate)
            done = self._emit(generated, out.fuzzy_mask, step.tokens, step.fuzzy_mask, eos, max_new_tokens, streamer)
            root = step.next_token
            clock.lap("other")
            if not done and reader is not None:
                reader.read(torch.tensor(step.tokens, device=prompt.device), features[step.path], speculate,
                            tree.level_slots(step.path) if speculate else None)
                clock.lap("draft")
            if guard is not None:
                guard.record(speculate, len(step.tokens), clock.last - step_start, verify_seconds, tree.size)
        if streamer is not None:
            streamer.end()
        out.finish(input_ids, generated, time.perf_counter() - start, clock.seconds)
        return out if return_dict else out.sequences

    def _draft(self, reader: DrafterReader, root: torch.Tensor, shape: TreeShape):
        """The next draft tree, after the drafter caught up on what it missed."""
        root_logits, root_state = reader.at_root()
        return grow_tree(reader.drafter, root, root_logits, root_state, shape)

    def _verify_and_accept(self, tree, cache: TreeCache, processor, fsd: FsdConfig | None, clock: PhaseClock,
                           layers: tuple[int, ...] | None = None, emitted: int = 0):
        """One target forward over the tree, acceptance, and the cache cut to the accepted path:
        (step, the tree's drafter features, verify seconds)."""
        committed = cache.get_seq_length()
        logits, features = self._verify(tree, cache, layers)
        verify_start = clock.last
        clock.lap("verify")
        verify_seconds = clock.last - verify_start
        step = self._accept(tree, logits, processor, fsd, emitted)
        clock.lap("accept")
        if step.path_is_prefix:  # the accepted nodes already sit at committed .. committed + a
            cache.crop(committed + step.accept_length + 1)
        else:
            cache.keep(committed, step.path)
        clock.lap("cache")
        return step, features, verify_seconds

    def _speed_guard(self, rule: FsdConfig | None = None) -> SpeedGuard:
        """The never-slower-than-plain guard for acceptance `rule` (a call's FsdConfig; threshold None or rule None:
        lossless), on with tuned settings (it needs the measured plain rate); the same guard for all of the model's
        calls under that rule."""
        if self._tuning is None:
            return SpeedGuard(None)
        rule = None if rule is None or rule.threshold is None else rule
        if rule not in self._guards:
            t = self._tuning  # predicted to lose: plain first (timing t_plain), speculation probed after 32 tokens
            self._guards[rule] = SpeedGuard(t.plain_ms, t.verify_ms, backoff=32, start_plain=not t.speculate,
                                            memory=self._guard_memory)
        return self._guards[rule]

    def _verify(self, tree, cache, layers: tuple[int, ...] | None = None):
        """All tree nodes in one target forward, node i at position committed + depth(i): (logits, the drafter's
        features: the final hidden states, or for EAGLE-3 those entering `layers`)."""
        committed = cache.get_seq_length()
        hidden, features = decoder_outputs(self.base_model, tree.tokens, cache,
                                           prefix_tree_mask(committed, tree.tree_mask), committed + tree.depths,
                                           self.attention, layers)
        return self.base_model.get_output_embeddings()(hidden), features

    def _accept(self, tree, logits, processor, fsd: FsdConfig | None, emitted: int = 0):
        return fsd_accept(tree, logits, choose_tokens(logits, processor), fsd, self.vocab_size, processor, emitted)

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


def load_model(settings: Settings) -> EaFsdModel:
    """EaFsdModel for a command's settings (eagle_fsd.loading.load_model)."""
    return loading.load_model(EaFsdModel, settings)
