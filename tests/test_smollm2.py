"""Integration on real weights: the SmolLM2-135M-Instruct preset in fp32 (fetched by the README's setup)."""
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eagle_fsd import presets
from eagle_fsd.attention import ATTENTION_NAME
from eagle_fsd.drafting import EagleDrafter, EagleHead, LMDrafter, head_config
from eagle_fsd.loading import plan_for
from eagle_fsd.model import EaFsdModel, exactness
from eagle_fsd.plan import WeightFormat
from eagle_fsd.quant import MAX_QUANT_ROWS, quant_supported
from eagle_fsd.tree.shape import TreeShape
from eagle_fsd.weights import format_weights

pytestmark = pytest.mark.slow

MIN_SHIPPED_TAU = 1.6  # a random head gives ~1.0; the shipped one measured 2.22 on these prompts, 1.87 on MT-Bench
PROMPTS = ["What is the capital of France? Answer in one sentence.",
           "List three prime numbers and explain why they are prime.",
           "Write a haiku about the sea."]


@pytest.fixture(scope="module", autouse=True)
def all_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(max(2, previous))
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def smollm2():
    path = presets.resolve_model("smollm2-135m-instruct")
    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=ATTENTION_NAME).eval()
    # Its first 4 layers are a real-weights LM drafter (a valid drafter that accepts little: fine for parity).
    truncated = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, num_hidden_layers=4,
                                                     attn_implementation=ATTENTION_NAME).eval()
    return target, truncated, AutoTokenizer.from_pretrained(path)


def encode(tokenizer, text):
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)["input_ids"]


def random_head(target):
    cfg, _, _ = head_config({**target.config.to_dict(), "num_hidden_layers": 1})
    cfg._attn_implementation = ATTENTION_NAME
    torch.manual_seed(0)
    return EagleHead(cfg).eval()


@pytest.mark.skipif(not quant_supported(4), reason="this PyTorch has no CPU int4 weight-only kernel")
def test_int4_drafter_is_lossless_on_real_weights(smollm2):
    """An int4 copy of the 4-layer real-weights drafter (prefill with its original weights, tree levels rounded):
    still exactly the fp32 target's greedy output."""
    target, _, tok = smollm2
    draft = AutoModelForCausalLM.from_pretrained(presets.resolve_model("smollm2-135m-instruct"), dtype=torch.float32,
                                                 num_hidden_layers=4, attn_implementation=ATTENTION_NAME).eval()
    assert format_weights(draft, WeightFormat("int4")) == 4 * 7 + 1  # every projection and the lm_head
    rounded_calls = []
    draft.model.layers[0].mlp.up_proj.register_forward_hook(
        lambda layer, args, out: rounded_calls.append(args[0].reshape(-1, layer.in_features).shape[0]
                                                      <= MAX_QUANT_ROWS))
    for shape in ((10, 1, 8), (7, 6, 1)):
        drafter = LMDrafter(draft, target.config.vocab_size)
        plan = plan_for(target, drafter, TreeShape(*shape), (None, WeightFormat("int4")))
        model = EaFsdModel(target, tok, drafter, plan=plan)
        ids = encode(tok, PROMPTS[0])
        reference = target.generate(ids, do_sample=False, max_new_tokens=48)
        out = model.generate(ids, max_new_tokens=48, return_dict=True)
        assert torch.equal(out.sequences, reference), tok.decode(out.sequences[0, ids.shape[1]:])
    assert any(rounded_calls) and not all(rounded_calls)  # tree levels ran int4, prefills the original weights


@pytest.mark.parametrize("drafter_kind,shape", [
    ("lm", (60, 5, 10)), ("lm", (10, 1, 8)), ("lm", (7, 6, 1)), ("eagle", (60, 5, 10)), ("eagle", (16, 3, 4)),
])
def test_greedy_is_the_targets_greedy(smollm2, drafter_kind, shape):
    target, truncated, tok = smollm2
    drafter = LMDrafter(truncated, target.config.vocab_size) if drafter_kind == "lm" else \
        EagleDrafter(random_head(target), target)
    model = EaFsdModel(target, tok, drafter, *shape)
    for text in PROMPTS[:2]:
        ids = encode(tok, text)
        reference = target.generate(ids, do_sample=False, max_new_tokens=48)
        out = model.generate(ids, max_new_tokens=48, return_dict=True)
        assert torch.equal(out.sequences, reference), tok.decode(out.sequences[0, ids.shape[1]:])
        assert out.new_tokens == reference.shape[1] - ids.shape[1]


def test_reducible_fsd_at_zero_is_bit_identical(smollm2):
    target, truncated, tok = smollm2
    model = EaFsdModel(target, tok, LMDrafter(truncated, target.config.vocab_size), 12, 3, 3)
    ids = encode(tok, PROMPTS[2])
    for temperature in (0.0, 0.8):
        runs = []
        for threshold in (None, 0.0):
            torch.manual_seed(7)
            runs.append(model.generate(ids, max_new_tokens=24, temperature=temperature, top_p=0.95,
                                       fsd_threshold=threshold))
        assert torch.equal(runs[0], runs[1])


def test_threshold_relaxes_every_step_monotonically(smollm2):
    """What reducible FSD guarantees (greedy, KL(q||p)). For one context and one draft tree the accepted path at a
    larger T extends the one at a smaller T (a lossless match wins wherever there is one; a larger T only adds fuzzy
    accepts where there is none), so the first step's accept length is non-decreasing in T for every context.
    T = 0 accepts nothing fuzzily; T = inf accepts at least one draft token every step (the root always has children:
    one matches or the top-ranked one is accepted). Whole generations need not be monotone in T: after the first
    step the contexts differ."""
    target, truncated, tok = smollm2
    model = EaFsdModel(target, tok, LMDrafter(truncated, target.config.vocab_size), 12, 4, 2)
    thresholds = (0.0, 0.5, 2.0, 8.0, math.inf)
    first_steps = []
    for text in PROMPTS[:2]:
        ids = encode(tok, text)
        reply = target.generate(ids, do_sample=False, max_new_tokens=24)
        for cut in range(0, reply.shape[1] - ids.shape[1] - 1, 6):  # contexts along the greedy reply
            context = reply[:, : ids.shape[1] + cut]
            # max_new_tokens=2: the prefill's token, then exactly one verification step
            first_steps.append([model.generate(context, max_new_tokens=2, fsd_threshold=t, return_dict=True)
                                .accept_lengths[0] for t in thresholds])
        lossless = model.generate(ids, max_new_tokens=24, fsd_threshold=0.0, return_dict=True)
        assert sum(lossless.fuzzy_accepts) == 0
        relaxed = model.generate(ids, max_new_tokens=24, fsd_threshold=math.inf, return_dict=True)
        assert min(relaxed.accept_lengths) >= 1 and sum(relaxed.fuzzy_accepts) > 0, relaxed.accept_lengths
    assert len(first_steps) >= 6 and all(steps == sorted(steps) for steps in first_steps), first_steps
    assert any(steps[-1] > steps[0] for steps in first_steps), first_steps  # T changes something


def test_shipped_head_is_the_default_drafter_and_lossless():
    """from_pretrained without a drafter loads the head shipped for the preset; greedy output stays the target's
    own, and the head is a trained one: it drafts tokens the target accepts (a random head gives tau ~1)."""
    model = EaFsdModel.from_pretrained("smollm2-135m-instruct", dtype=torch.float32, total_token=24, depth=5, top_k=4)
    assert isinstance(model.drafter, EagleDrafter)
    steps = tokens = 0
    for text in PROMPTS:
        ids = encode(model.tokenizer, text)
        reference = model.naive_generate(ids, max_new_tokens=64)
        out = model.generate(ids, max_new_tokens=64, return_dict=True)
        assert torch.equal(out.sequences, reference)
        steps, tokens = steps + out.verify_steps, tokens + sum(a + 1 for a in out.accept_lengths)
    assert tokens / steps > MIN_SHIPPED_TAU, tokens / steps  # tau: tokens per target forward


def test_auto_settings_tune_once_and_stay_lossless():
    """A preset's default tree is "auto": the cost model measured on this machine (cached) picks the tree and the
    draft vocabulary; whatever it picks, greedy output is the target's own, and the cached profile is reused."""
    model = EaFsdModel.from_pretrained("smollm2-135m-instruct", dtype=torch.float32)
    tuning = model.tuning
    assert tuning is not None and tuning.shape[:3] == (model.total_token, model.depth, model.top_k)
    vocab = model.drafter.draft_vocab
    assert (vocab is None) == (tuning.shape[3] == 0) and (vocab is None or vocab.numel() == tuning.shape[3])
    for text in PROMPTS:
        ids = encode(model.tokenizer, text)
        out = model.generate(ids, max_new_tokens=48, return_dict=True)
        assert torch.equal(out.sequences, model.naive_generate(ids, max_new_tokens=48))
    again = EaFsdModel.from_pretrained("smollm2-135m-instruct", dtype=torch.float32)
    assert again.tuning.path == tuning.path  # the same cache entry (checked at load, re-timed only if it drifted)


def test_bf16_speculation_parts_from_plain_decoding_only_at_near_ties(smollm2):
    """The README's bf16 statement: speculation scores a step's tokens in one forward, and bf16 rounds differently
    with the number of tokens, so its greedy text may part from plain bf16 decoding, but only where the target's
    (fp32) top two choices nearly tie. Where they agree, nothing is claimed beyond equality."""
    target32, _, tok = smollm2
    model = EaFsdModel.from_pretrained("smollm2-135m-instruct", dtype=torch.bfloat16, total_token=24, depth=5,
                                       top_k=4, draft_vocab=0)
    assert "fp32" in exactness(torch.bfloat16) and "token for token" in exactness(torch.float32)
    for text in PROMPTS:
        ids = encode(tok, text)
        spec = model.generate(ids, max_new_tokens=96)
        plain = model.naive_generate(ids, max_new_tokens=96)
        n = min(spec.shape[1], plain.shape[1])
        differ = (spec[0, :n] != plain[0, :n]).nonzero()
        if not differ.numel():
            continue
        at = int(differ[0, 0])
        with torch.no_grad():
            logits = target32(spec[:, :at]).logits[0, -1]
        gap = (logits[spec[0, at]] - logits[plain[0, at]]).abs().item()
        assert gap < 0.5, (text, at, gap)  # a near-tie (the logits are ~20), not a wrong choice
