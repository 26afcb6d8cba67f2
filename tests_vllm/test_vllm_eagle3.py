"""Our EAGLE-3 head served by vLLM: a head trained here for real SmolLM2-135M-Instruct (about a minute, on the
target's own replies to 64 short questions), written with `train-head --export speculators`, and loaded the way
`vllm serve HEAD_DIR` loads it: vLLM reads the speculators config, takes the target from its verifier entry and
drafts with the head (method eagle3). Runs in the vLLM environment (README, Test).
"""
import gc
import json
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import pytest  # noqa: E402
from pair import counters, target_dir  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402

TOPICS = ("the sun", "rain", "a cat", "bread", "the ocean", "music", "a tree", "winter", "a bicycle", "coffee",
          "a library", "the wind", "a mountain", "chess", "a river", "snow")
QUESTIONS = ("What is {}?", "Tell me a fact about {}.", "Describe {} in one sentence.", "Why does {} matter?")
PROMPTS = ["What is the moon?", "Tell me a fact about a dog.", "Describe a forest in one sentence.",
           "Why does sleep matter?"]  # questions the head was not trained on
TOKENS = 48
GREEDY = SamplingParams(temperature=0, max_tokens=TOKENS)


def chats(prompts):
    return [[{"role": "user", "content": p}] for p in prompts]


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    from eagle_fsd.train.cli import main

    folder = tmp_path_factory.mktemp("eagle3")
    data = folder / "questions.jsonl"
    data.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": q.format(t)},
                                                       {"role": "assistant", "content": "-"}]})
                              for t in TOPICS for q in QUESTIONS))
    out = folder / "head"
    assert main(["--arch", "eagle3", "--base", target_dir(), "--data", str(data), "--self-distill", "64",
                 "--gen-tokens", "96", "--gen-batch", "32", "--draft-vocab", "2048", "--ttt-steps", "2",
                 "--epochs", "3", "--batch-size", "8", "--lr", "1e-3", "--export", "speculators",
                 "--verifier", target_dir(), "--out", str(out), "--no-progress", "--eval-every", "1000",
                 "--save-every", "1000"]) == 0
    return out


@pytest.fixture(scope="module")
def plain(head):
    """vLLM's own greedy replies, no speculation (the engine is gone before the next one is made)."""
    llm = LLM(model=target_dir(), dtype="float32", max_model_len=512, enforce_eager=True, seed=0)
    replies = [list(o.outputs[0].token_ids) for o in llm.chat(chats(PROMPTS), GREEDY)]
    del llm
    gc.collect()
    return replies


@pytest.fixture(scope="module")
def served(head, plain):
    """`vllm serve HEAD_DIR` in process: the model named is the head's folder."""
    llm = LLM(model=str(head), dtype="float32", max_model_len=512, enforce_eager=True, seed=0,
              disable_log_stats=False, enable_prefix_caching=False)
    yield llm
    del llm
    gc.collect()


def test_exported_head_names_its_target(head):
    config = json.loads((head / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == target_dir()
    assert config["speculators_model_type"] == "eagle3"


def test_vllm_serves_the_head_with_its_own_greedy_output(served, plain):
    speculative = served.llm_engine.vllm_config.speculative_config
    assert speculative.method == "eagle3" and speculative.num_speculative_tokens == 5
    drafts0, accepted0 = counters(served)
    replies = [list(o.outputs[0].token_ids) for o in served.chat(chats(PROMPTS), GREEDY)]
    drafts1, accepted1 = counters(served)
    assert replies == plain
    assert drafts1 > drafts0 and accepted1 > accepted0  # the head drafts, and vLLM keeps some of its tokens
