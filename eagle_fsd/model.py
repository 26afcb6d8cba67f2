"""EaFsdModel: a target model, a proposer, and the one generation loop (draft -> verify -> accept -> emit)."""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

import eagle_fsd.attention  # noqa: F401  (registers the "eagle_fsd" attention function)
from eagle_fsd import loading, vocab
from eagle_fsd.attention import check_attention_support, check_backend
from eagle_fsd.cache import TreeCache
from eagle_fsd.drafting import Plain
from eagle_fsd.dtypes import dtype_name
from eagle_fsd.fsd import FsdConfig, fsd_accept, resolve_fsd
from eagle_fsd.guard import GuardMemory, SpeedGuard
from eagle_fsd.hf import causal_mask, decoder_outputs, prefix_tree_mask
from eagle_fsd.plan import RunPlan, rule_key
from eagle_fsd.sampling import choose_tokens, logits_processor
from eagle_fsd.settings import Settings
from eagle_fsd.steps import GenerateOutput, StepPolicy
from eagle_fsd.tree.shape import TreeShape
from eagle_fsd.tune import Tuning
from eagle_fsd.tune.follow import ShapeFollower, best_shape
from eagle_fsd.tune.rule_replay import calibration_sequences, rule_rescue

__all__ = ["EaFsdModel", "GenerateOutput", "eos_token_ids", "exactness", "load_model"]


@dataclass
class Request:
    """One generate call: its logits processor, stop tokens, token budget, streamer and acceptance rule."""

    processor: object
    eos: set[int]
    max_new_tokens: int
    streamer: object = None
    fsd: FsdConfig | None = None
    stop_ids: torch.Tensor | None = None  # the stop tokens as a tensor, where FsdConfig.keep_stop reads them


@dataclass
class Decoding:
    """The loop's state: the target's cache, the next tree's root, the proposer's session and the tokens so far."""

    cache: TreeCache
    root: torch.Tensor
    session: object
    out: GenerateOutput
    generated: list[int] = field(default_factory=list)
    done: bool = False

    def emit(self, tokens: list[int], fuzzy: list[bool], request: Request) -> None:
        """Append a step's tokens (and their FSD flags), cut at the first stop token or at the token budget; done
        then. A streamer with a `put_fuzzy_mask` method gets the flags before the tokens (the chat demo colours
        fuzzily accepted tokens with them)."""
        kept = []
        for token in tokens[: request.max_new_tokens - len(self.generated)]:
            kept.append(token)
            if token in request.eos:
                break
        self.generated.extend(kept)
        self.out.fuzzy_mask.extend(fuzzy[: len(kept)])
        if request.streamer is not None and kept:
            if hasattr(request.streamer, "put_fuzzy_mask"):
                request.streamer.put_fuzzy_mask(fuzzy[: len(kept)])
            request.streamer.put(torch.tensor(kept))
        self.done = (bool(kept) and kept[-1] in request.eos) or len(self.generated) >= request.max_new_tokens


def exactness(dtype: torch.dtype, target_quantized: bool = False) -> str:
    """What lossless greedy speculation guarantees in `dtype`: in fp32 the target's own greedy tokens; in a 16-bit
    dtype the target's greedy choice computed by forwards over several tokens, whose rounding depends on how many
    tokens a forward holds (measured agreement with plain decoding: README, BENCHMARKS.md). A quantized target
    (eagle_fsd.target_quant) is the model it is exact against."""
    if target_quantized:
        return ("greedy output is plain greedy decoding of the quantized target (the preset GGUF's own Q4_K / Q6_K "
                "blocks where it is cached, else int4 / int8 weights rounded from the preset's; 8-bit activations per "
                "row, fp32 elsewhere), token for token; --target-quant off keeps the float weights")
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
    Eagle3Drafter or LMDrafter (None: plain decoding only; eagle_fsd.loading builds one). plan: how the model runs
    (eagle_fsd.plan.RunPlan, made by the loader; None: float weights as loaded, EAGLE's total_token / depth / top_k
    as the tree). `tuning`: the cost model's choice of the tree (eagle_fsd.tune), which turns the speed guard on.
    `generate` takes another tree per call.
    """

    def __init__(self, base_model, tokenizer=None, drafter=None, total_token: int = 60, depth: int = 5,
                 top_k: int = 10, plan: RunPlan | None = None, tuning: Tuning | None = None):
        super().__init__()
        self.plan = plan or loading.plan_for(base_model, drafter, TreeShape(total_token, depth, top_k))
        check_backend(self.plan.target.backend)
        check_attention_support(base_model.config)  # sliding windows are honoured; other kinds are refused
        self.base_model = base_model
        self.tokenizer = tokenizer
        self.drafter = drafter
        self._tuning = None
        self._guards: dict[FsdConfig | None, SpeedGuard] = {}  # the speed guard per acceptance rule, for life
        self._trees: dict[FsdConfig | None, ShapeFollower] = {}  # the draft tree per acceptance rule, for life
        self._guard_memory = GuardMemory()  # what the guards measured, shared by them
        # the token vocabulary: logit rows beyond it (padding) are not tokens
        self.vocab_size = len(tokenizer) if tokenizer is not None else base_model.config.vocab_size
        self._vocab_ids = {0: None}  # draft vocabulary size -> its target ids (0: the drafter's own)
        if drafter is not None:
            drafter.run = self.plan.drafter
        if tuning is not None:
            self.use_tuning(tuning)
        elif drafter is not None and self.plan.draft_vocab:
            drafter.set_draft_vocab(self._draft_vocab_ids(self.plan.draft_vocab))

    def use_tuning(self, tuning: Tuning) -> None:
        """The cost model's choice: its tree becomes the model's, and the speed guard uses its measured costs."""
        self._tuning = tuning
        self.plan = self.plan.with_tree(tuning.tree, tuned=True)
        self._trees.clear()
        if self.drafter is not None:
            self.drafter.set_draft_vocab(self._draft_vocab_ids(self.plan.draft_vocab))

    @property
    def shape(self) -> TreeShape:
        return self.plan.tree

    @property
    def tuning(self) -> Tuning | None:
        return self._tuning

    # EAGLE's names for the tree
    total_token = property(lambda self: self.shape.total_token)
    depth = property(lambda self: self.shape.depth)
    top_k = property(lambda self: self.shape.branching)

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
        "auto" or forced; see eagle_fsd.loading.load_pretrained. Other keyword arguments go to transformers'
        from_pretrained."""
        options = loading.LoadOptions(dtype, device_map, attention, tune_progress, prepack, draft_quant, target_quant)
        return loading.load_pretrained(cls, base_model, (ea_model_path, draft_model),
                                       (total_token, depth, top_k, draft_vocab), options, kwargs)

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
        shape: the draft tree of this call, as given (no speed guard); None: the plan's tree for the call's rule."""
        if self.drafter is None:
            raise ValueError("this EaFsdModel has no drafter: pass ea_model_path= or draft_model= to from_pretrained, "
                             "or use naive_generate for plain decoding")
        rule = resolve_fsd(fsd, fsd_threshold)
        trees = self.trees_for(rule) if shape is None else ShapeFollower(None, shape)
        request = self._request(input_ids, (temperature, top_p, top_k), max_new_tokens, eos_token_id, streamer,
                                (trees.room, rule))
        switched = trees.at_context(input_ids.shape[1] + max_new_tokens / 2)  # the tree for this call's context
        guard = self._speed_guard(rule) if shape is None else SpeedGuard(None)
        with self._drafting_for(trees.shape):
            out = self._generate(input_ids, self.drafter, request, StepPolicy(trees, guard, True, profile))
        out.tree_switches += switched
        return out if return_dict else out.sequences

    def trees_for(self, rule: FsdConfig | None = None) -> ShapeFollower:
        """The draft tree of acceptance `rule` (None: lossless), kept for the model's life and re-chosen from the
        acceptance the rule measures (eagle_fsd.tune.follow). With tuned settings a rule without a tree of its own
        in the plan starts on the tree the cost model predicts fastest at its replayed rescue rate
        (eagle_fsd.tune.rule_replay); untuned, every rule runs the plan's tree, fixed."""
        key = rule_key(rule)
        if key not in self._trees:
            profile = None if self._tuning is None else self._tuning.profile
            tree, rescue = self.plan.tree_for(key), 0.0
            if profile is not None and key is not None and key not in dict(self.plan.trees):
                stop_ids = torch.tensor(sorted(eos_token_ids(self.base_model)), dtype=torch.long)
                rescue = rule_rescue(self, calibration_sequences(self, profile), key, stop_ids)
                tree = TreeShape(*best_shape(profile, rescue, self.plan.draft_vocab)[0])
                self.plan = self.plan.with_tree(tree, key)
            self._trees[key] = ShapeFollower(profile, tree, rescue)
        return self._trees[key]

    def _drafting_for(self, shape: TreeShape):
        """The drafter over `shape`'s draft vocabulary for one call, when it is not the model's own."""
        if shape.draft_vocab == self.plan.draft_vocab:
            return nullcontext()
        return self.drafter.drafting_over(self._draft_vocab_ids(shape.draft_vocab))

    @torch.no_grad()
    def naive_generate(self, input_ids, max_new_tokens: int = 512, temperature: float = 0.0, top_p: float = 1.0,
                       top_k: int = 0, streamer=None, return_dict: bool = False, eos_token_id=None):
        """Plain decoding with the target alone (one token per forward): the baseline of every speed figure."""
        request = self._request(input_ids, (temperature, top_p, top_k), max_new_tokens, eos_token_id, streamer)
        out = self._generate(input_ids, Plain(), request,
                             StepPolicy(ShapeFollower(None, self.shape), SpeedGuard(None), False))
        return out if return_dict else out.sequences

    # EAGLE's names, so EAGLE users can switch
    def eagenerate(self, input_ids, temperature=0.0, top_p=0.0, top_k=0.0, max_new_tokens=512, max_length=2048,
                   log=False, is_llama3=False):
        return self._eagle_call(self.generate, input_ids, (temperature, top_p, top_k), (max_new_tokens, max_length),
                                log, is_llama3)

    def naivegenerate(self, input_ids, temperature=0.0, top_p=0.0, top_k=0.0, max_new_tokens=512, max_length=2048,
                      log=False, is_llama3=False):
        return self._eagle_call(self.naive_generate, input_ids, (temperature, top_p, top_k),
                                (max_new_tokens, max_length), log, is_llama3)

    def _eagle_call(self, fn, input_ids, sampling: tuple, budget: tuple, log: bool, is_llama3: bool):
        # EAGLE: top_p 0 and top_k 0.0 mean "off"; max_length caps prompt + new tokens.
        temperature, top_p, top_k = sampling
        max_new_tokens = min(budget[0], budget[1] - input_ids.shape[-1])
        eos = None
        if is_llama3:
            eos = sorted(eos_token_ids(self.base_model) | {self.tokenizer.convert_tokens_to_ids("<|eot_id|>")})
        out = fn(input_ids, max_new_tokens=max_new_tokens, temperature=temperature,
                 top_p=top_p if 0 < top_p < 1 else 1.0, top_k=int(top_k), return_dict=True, eos_token_id=eos)
        return (out.sequences, out.new_tokens, out.verify_steps - 1) if log else out.sequences

    def _request(self, input_ids, sampling: tuple, max_new_tokens, eos_token_id, streamer,
                 speculation: tuple = (None, None)) -> Request:
        """A call's Request, its arguments checked. sampling: (temperature, top_p, top_k); speculation: the call's
        (tree, acceptance rule), the tree checked."""
        tree, rule = speculation
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"input_ids must have shape (1, prompt_len); got {tuple(input_ids.shape)} "
                             "(batch size > 1 is not supported)")
        if input_ids.shape[1] == 0:
            raise ValueError("input_ids is empty: give at least one prompt token")
        if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a positive int")
        vocab_size = self.base_model.config.vocab_size
        if tree is not None and tree.branching > vocab_size:
            raise ValueError(f"tree branching (EAGLE's top_k) {tree.branching} exceeds the vocabulary size "
                             f"{vocab_size}")
        context = getattr(self.base_model.config, "max_position_embeddings", None)
        needed = input_ids.shape[1] + max_new_tokens
        if context is not None and needed > context:
            raise ValueError(f"prompt ({input_ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) = {needed} "
                             f"exceeds the model's context of {context} tokens; shorten the prompt or lower "
                             "max_new_tokens")
        eos = eos_token_ids(self.base_model, eos_token_id)
        stop_ids = torch.tensor(sorted(eos), dtype=torch.long) if rule is not None and rule.keep_stop else None
        return Request(logits_processor(*sampling), eos, max_new_tokens, streamer, rule, stop_ids)

    def _generate(self, input_ids, proposer, request: Request, steps: StepPolicy) -> GenerateOutput:
        """The loop: each step drafts a tree (the root alone where it decodes plainly), verifies it in one target
        forward, accepts the longest branch the rule takes and emits it; the proposer then reads what was emitted."""
        state = self._prefill(input_ids, proposer, request, steps)
        steps.start_steps()
        while not state.done:
            speculate = steps.speculate()
            if speculate and state.session.read_prompt():
                steps.lap("draft_prefill")  # once a call, like the target's prefill: not a step's cost
            steps.begin_step()
            tree = state.session.draft(state.root, steps.shape, speculate)
            steps.lap("draft")
            step, features = self._verify_and_accept(tree, state.cache, request, steps, len(state.generated))
            state.emit(step.tokens, step.fuzzy_mask, request)
            state.root = step.next_token
            steps.lap("other")
            if not state.done:
                state.session.read(step, features, tree, speculate)
                steps.lap("draft")
            steps.record(state.out, step, tree.size, speculate)
        if request.streamer is not None:
            request.streamer.end()
        return steps.finish(state.out, input_ids, state.generated)

    def _prefill(self, input_ids, proposer, request: Request, steps: StepPolicy) -> Decoding:
        """The target reads the prompt and chooses the first new token, which roots the first tree; the proposer's
        session starts (a drafter reads the prompt at its first draft)."""
        prompt = input_ids[0].to(self.base_model.device)
        n = prompt.numel()
        room = proposer.tree_room(steps.room)
        cache = TreeCache.for_model(self.base_model, n + request.max_new_tokens + room, self.plan.target)
        if request.streamer is not None:
            request.streamer.put(input_ids.cpu())
        hidden, features = decoder_outputs(self.base_model, prompt, cache, causal_mask(0, n, prompt.device),
                                           torch.arange(n, device=prompt.device), self.plan.target,
                                           proposer.feature_layers)
        root = choose_tokens(self.base_model.get_output_embeddings()(hidden[-1:]), request.processor)[0]
        session = proposer.session(cache.max_len + steps.room.level_room, prompt, root, features)
        state = Decoding(cache, root, session, GenerateOutput(sequences=input_ids))
        state.emit([int(root)], [False], request)
        return state

    def _verify_and_accept(self, tree, cache: TreeCache, request: Request, steps: StepPolicy, emitted: int = 0):
        """One target forward over the tree, acceptance, and the cache cut to the accepted path: (step, the tree's
        drafter features)."""
        committed = cache.get_seq_length()
        logits, features = self._verify(tree, cache, self.drafter.feature_layers if steps.speculative else None)
        steps.lap("verify")
        step = fsd_accept(tree, logits, choose_tokens(logits, request.processor), request.fsd, self.vocab_size,
                          request.processor, emitted, request.stop_ids)
        steps.lap("accept")
        cache.keep(committed, step.path)  # a path 0..a already in place is only cropped to it
        steps.lap("cache")
        return step, features

    def _speed_guard(self, rule: FsdConfig | None = None) -> SpeedGuard:
        """The never-slower-than-plain guard for acceptance `rule` (a call's FsdConfig; threshold None or rule None:
        lossless), on with tuned settings (it needs the measured plain rate); the same guard for all of the model's
        calls under that rule."""
        if self._tuning is None:
            return SpeedGuard(None)
        rule = rule_key(rule)
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
                                           self.plan.target, layers)
        return self.base_model.get_output_embeddings()(hidden), features


def load_model(settings: Settings) -> EaFsdModel:
    """EaFsdModel for a command's settings (eagle_fsd.loading.load_model)."""
    return loading.load_model(EaFsdModel, settings)
