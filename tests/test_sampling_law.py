"""The law of several new tokens under sampling, over several tree steps (chi-square against exact laws).

tests/test_sampling.py checks one tree step (two tokens). Here generate emits K = 5 tokens over 2-4 steps, so cache
compaction (an accepted path that is not the node prefix 0..a), the drafter's extension with accepted tokens, and
its catch-up after plainly decoded steps all run under sampling. On a target with a tiny vocabulary the exact law of
the target's own sampling is enumerable:
    P(e_1 .. e_K) = prod_i p(e_i | prompt, e_1 .. e_{i-1}),
p the processed (temperature / top-k / top-p) next-token distribution, and generate's tokens must follow it.
Sequences outside the support (probability exactly 0) must never appear; the rest is Pearson's chi-square with
cells of expected count < 5 pooled, p > 1e-4 with fixed seeds (deterministic, and far from the threshold).
"""
import copy
import math

import pytest
import torch

import eagle_fsd.fsd
from eagle_fsd.divergence import DIVERGENCES
from eagle_fsd.drafting import EagleDrafter, EagleHead, LMDrafter
from eagle_fsd.fsd import FsdConfig
from eagle_fsd.model import EaFsdModel, SpeedGuard
from eagle_fsd.sampling import logits_processor, processed_probs
from tiny import tiny_config, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, K = 8, 5
PROMPT = [3, 1, 4, 1]
SMALL = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64)


def target_and_drafter(noise=0.5):
    """A tiny target whose next token depends strongly on its context (attention values and output scaled x3: a
    wrong cache entry moves p by ~0.2 in total variation, against ~0.06 unscaled) and sharpened, and a noisy copy of
    it as drafter (each weight matrix moved by `noise` times its own spread): they agree often, not always, so steps
    accept 0..depth tokens, often down a child that is not the first sibling (cache compaction)."""
    target = tiny_model(vocab=VOCAB, seed=11, **SMALL)
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.v_proj.weight.mul_(3)
            layer.self_attn.o_proj.weight.mul_(3)
        target.lm_head.weight.mul_(12)
    draft = copy.deepcopy(target)
    torch.manual_seed(12)
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() == 2:
                p.add_(noise * p.std() * torch.randn_like(p))
    return target, draft


def eagle_drafter(target):
    torch.manual_seed(5)
    return EagleDrafter(EagleHead(tiny_config("llama", vocab=VOCAB, **SMALL)).eval(), target)


@torch.no_grad()
def next_probs(model, rows: list[list[int]], processor) -> torch.Tensor:
    """(len(rows), V) processed next-token distributions of `model` after each (equal-length) row."""
    return processed_probs(model(torch.tensor(rows)).logits[:, -1], processor).double()


def exact_law(target, processor, k=K, floor=1e-7) -> dict[tuple, float]:
    """{(e_1..e_k): P} for the target's own sampling, sequences under `floor` left out (their mass is pooled)."""
    law = {(): 1.0}
    for _ in range(k):
        seqs = list(law)
        rows = next_probs(target, [PROMPT + list(s) for s in seqs], processor).tolist()
        law = {s + (t,): law[s] * p for s, row in zip(seqs, rows) for t, p in enumerate(row) if law[s] * p >= floor}
    return law


@torch.no_grad()
def sequence_prob(target, processor, seq) -> float:
    """Exact probability of one sequence (for samples outside the enumerated table), from one forward."""
    logits = target(torch.tensor([PROMPT + list(seq)])).logits[0, len(PROMPT) - 1: -1]
    probs = processed_probs(logits, processor).double()
    return math.prod(float(probs[i, t]) for i, t in enumerate(seq))


def chi2_pvalue(observed: list[float], expected: list[float]) -> float:
    """Pearson chi-square goodness of fit; cells with expected count < 5 are pooled into one."""
    obs, exp = torch.tensor(observed, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64)
    small = exp < 5
    obs = torch.cat([obs[~small], obs[small].sum()[None]])
    exp = torch.cat([exp[~small], exp[small].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2))


def sample(generate, n: int, seed: int = 0, outputs: list | None = None) -> dict[tuple, int]:
    """Counts of the new-token sequences of n calls of generate (a GenerateOutput or ids); `outputs` collects the
    GenerateOutputs."""
    torch.manual_seed(seed)
    counts: dict[tuple, int] = {}
    for _ in range(n):
        out = generate()
        if outputs is not None:
            outputs.append(out)
        ids = out if isinstance(out, torch.Tensor) else out.sequences
        seq = tuple(ids[0, len(PROMPT):].tolist())
        assert len(seq) == K
        counts[seq] = counts.get(seq, 0) + 1
    return counts


def assert_follows(counts: dict[tuple, int], law: dict[tuple, float], target, processor, p_min=1e-4):
    """No impossible sequence was sampled, and the counts fit the law (chi-square p > p_min)."""
    n = sum(counts.values())
    outside = {s: c for s, c in counts.items() if s not in law}
    impossible = {s: c for s, c in outside.items() if sequence_prob(target, processor, s) == 0.0}
    assert not impossible, f"sampled sequences the target gives probability 0: {impossible}"
    cells = list(law)
    observed = [counts.get(s, 0) for s in cells] + [sum(outside.values())]
    expected = [n * law[s] for s in cells] + [n * max(0.0, 1.0 - sum(law.values()))]
    p = chi2_pvalue(observed, expected)
    assert p > p_min, f"chi-square p = {p:.2e}"


def generator(model, temperature, top_p, top_k, **kwargs):
    ids = torch.tensor([PROMPT])
    return lambda: model.generate(ids, max_new_tokens=K, temperature=temperature, top_p=top_p, top_k=top_k,
                                  eos_token_id=[], **kwargs)


# Filtered settings (top-k / top-p) also test the support: a wrong cache entry or a wrong acceptance shows as a
# sequence the target gives probability 0, which the chi-square alone would need many more samples to see.
SETTINGS = {"T0.7-topk3": (0.7, 1.0, 3), "T1.3-topp0.8": (1.3, 0.8, 0)}
N = 800  # samples per test: about 10 ms each (a few tree steps of tiny models)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_lm_drafter_joint_law(setting):
    temperature, top_p, top_k = SETTINGS[setting]
    target, draft = target_and_drafter()
    model = EaFsdModel(target, None, LMDrafter(draft, VOCAB), total_token=8, depth=3, top_k=2)
    processor = logits_processor(temperature, top_p, top_k)
    counts = sample(generator(model, temperature, top_p, top_k), N)
    assert_follows(counts, exact_law(target, processor), target, processor)


def test_eagle_head_joint_law(temperature=0.9, top_p=0.9, top_k=4):
    target, _ = target_and_drafter()
    model = EaFsdModel(target, None, eagle_drafter(target), total_token=6, depth=3, top_k=2)
    processor = logits_processor(temperature, top_p, top_k)
    counts = sample(generator(model, temperature, top_p, top_k), 4 * N // 5)
    assert_follows(counts, exact_law(target, processor), target, processor)


def test_catch_up_after_plain_steps_joint_law(temperature=1.0, top_k=4):
    """The speed guard decodes the first 2 tokens plainly (the drafter reads nothing), then speculation resumes and
    the drafter catches up on the tokens it missed in one forward: the law is unchanged."""
    target, draft = target_and_drafter()
    model = EaFsdModel(target, None, LMDrafter(draft, VOCAB), total_token=8, depth=3, top_k=2)
    model._speed_guard = lambda rule=None: SpeedGuard(plain_ms=1e9, backoff=2, start_plain=True)
    outputs = []
    counts = sample(generator(model, temperature, 1.0, top_k, return_dict=True), 4 * N // 5, outputs=outputs)
    assert {out.plain_steps for out in outputs} == {2}  # 2 plain steps, then speculation
    assert max(max(out.accept_lengths) for out in outputs) > 0
    processor = logits_processor(temperature, 1.0, top_k)
    assert_follows(counts, exact_law(target, processor), target, processor)


def test_fsd_at_zero_threshold_processed_top_k_joint_law(temperature=0.8, top_k=5):
    """Reducible FSD at T = 0 over processed distributions with the top-K divergence is still lossless."""
    target, draft = target_and_drafter()
    model = EaFsdModel(target, None, LMDrafter(draft, VOCAB), total_token=8, depth=3, top_k=2)
    processor = logits_processor(temperature, 1.0, top_k)
    fsd = FsdConfig(0.0, "jsd", distributions="processed", top_k=3)
    counts = sample(generator(model, temperature, 1.0, top_k, fsd=fsd), 4 * N // 5)
    assert_follows(counts, exact_law(target, processor), target, processor)


def test_original_fsd_at_zero_threshold_is_plain_sampling(temperature=1.0, top_p=0.9):
    """Original FSD at T = 0 accepts only where D is exactly 0 (never, for this drafter): each step emits one
    sample of the target, so the law is plain sampling's."""
    target, draft = target_and_drafter()
    model = EaFsdModel(target, None, LMDrafter(draft, VOCAB), total_token=4, depth=1, top_k=3)
    processor = logits_processor(temperature, top_p)
    outputs = []
    counts = sample(generator(model, temperature, top_p, 0, fsd=FsdConfig(0.0, mode="original"),
                              return_dict=True), 4 * N // 5, outputs=outputs)
    assert {a for out in outputs for a in out.accept_lengths} == {0}
    assert_follows(counts, exact_law(target, processor), target, processor)


@torch.no_grad()
def fuzzy_chain_law(target, draft, processor, depth) -> dict[tuple, float]:
    """Exact law of reducible FSD at T = inf on a chain tree (top_k = 1) of `depth` draft tokens: every step accepts
    the drafter's greedy chain c_1..c_depth after its root (matched or fuzzily) and ends with one sample of the target
    after it. The first token is the target's sample after the prompt."""
    law = {(): 1.0}
    while True:
        grown = {}
        for seq, prob in law.items():
            if len(seq) == K:
                grown[seq] = prob
                continue
            ctx = PROMPT + list(seq)
            if seq:  # after a root: the drafter's greedy chain, deterministic (raw logits, full vocabulary)
                for _ in range(depth):
                    if len(ctx) - len(PROMPT) == K:
                        break
                    ctx = ctx + [int(draft(torch.tensor([ctx])).logits[0, -1].argmax())]
            if len(ctx) - len(PROMPT) == K:
                grown[tuple(ctx[len(PROMPT):])] = prob
                continue
            probs = next_probs(target, [ctx], processor)[0]
            for t in range(VOCAB):
                if probs[t] > 0:
                    grown[tuple(ctx[len(PROMPT):]) + (t,)] = prob * float(probs[t])
        if grown == law:
            return law
        law = grown


def test_fsd_infinite_threshold_chain_joint_law(temperature=0.9, top_k=4):
    """Reducible FSD at T = inf (tv: D is finite) over processed distributions on a chain: the fuzzy rule accepts
    the drafter's whole chain and each step ends with a sample of the target after it (law above)."""
    target, draft = target_and_drafter()
    model = EaFsdModel(target, None, LMDrafter(draft, VOCAB), total_token=3, depth=2, top_k=1)
    processor = logits_processor(temperature, 1.0, top_k)
    fsd = FsdConfig(math.inf, "tv", distributions="processed")
    counts = sample(generator(model, temperature, 1.0, top_k, fsd=fsd), 2 * N // 5)
    law = fuzzy_chain_law(target, draft, processor, depth=2)
    assert_follows(counts, law, target, processor)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter evaluates both
def test_fused_divergence_equals_reference_on_tree_nodes(monkeypatch):          # sides of tl.where (-inf - -inf)
    """The fused Triton divergence (CUDA's path in node_divergences; interpreted here) on the nodes of real trees,
    over processed distributions (-inf outside top-k), equals eagle_fsd.divergence.divergence for every divergence;
    generate then runs on the fused values."""
    from eagle_fsd.kernels import fused_divergence

    reference = eagle_fsd.fsd.divergence
    compared = []

    def both(target, draft, name, top_k=None):
        expected = reference(target, draft, name, top_k=top_k)
        if top_k is not None:
            return expected
        got = fused_divergence(target, draft, name)
        assert torch.allclose(got, expected, rtol=1e-4, atol=1e-5, equal_nan=True), (name, got, expected)
        compared.append((name, bool(torch.isinf(target).any())))
        return got

    monkeypatch.setattr(eagle_fsd.fsd, "divergence", both)
    target, draft = target_and_drafter()
    model = EaFsdModel(target, None, LMDrafter(draft, VOCAB), total_token=8, depth=3, top_k=2)
    ids = torch.tensor([PROMPT])
    torch.manual_seed(0)
    for name in DIVERGENCES:
        model.generate(ids, max_new_tokens=6, temperature=0.8, top_k=4, eos_token_id=[],
                       fsd=FsdConfig(0.3, name, distributions="processed"))
    assert {name for name, _ in compared} == set(DIVERGENCES)
    assert all(masked for _, masked in compared)  # top-k left -inf logits in every compared row set
