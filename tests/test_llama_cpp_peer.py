"""llama.cpp as a bench peer (eval/llama_cpp_peer.py and its flags in eval/bench.py).

The wiring and the errors need no llama.cpp. The real-model tests need llama-cpp-python (an optional, source-built
install: README, Compare with llama.cpp) and the SmolLM2 preset's GGUF already in the cache (`eagle-fsd models gguf
smollm2-135m-instruct`); without either they are skipped, never faked.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from eagle_fsd.eval import bench, llama_cpp_peer
from eagle_fsd.presets.build import gguf_path

SMOLLM2 = "smollm2-135m-instruct"
QWEN = "qwen2.5-coder-1.5b-instruct"


def job_for(*argv: str) -> bench.BenchJob:
    job, _ = bench.parse_args(list(argv))
    return job


@pytest.fixture
def fetched(monkeypatch):
    """bench's fetch_gguf recorded instead of downloading: preset name -> a made-up path."""
    names = []

    def fake_fetch(name):
        names.append(name)
        return Path(f"/cache/gguf/{name}.gguf")
    monkeypatch.setattr(bench, "fetch_gguf", fake_fetch)
    return names


def test_default_ggufs_are_the_presets_own_files(fetched):
    target, draft = bench.llama_cpp_ggufs(job_for("--model", QWEN, "--also-llama-cpp"))
    assert (target, draft) == (f"/cache/gguf/{QWEN}.gguf", "/cache/gguf/qwen2.5-coder-0.5b-instruct.gguf")
    assert fetched == [QWEN, "qwen2.5-coder-0.5b-instruct"]


def test_no_draft_row_when_asked_or_when_drafting_with_a_head(fetched, tmp_path):
    assert bench.llama_cpp_ggufs(job_for("--model", QWEN, "--also-llama-cpp", "--llama-cpp-draft", "none"))[1] is None
    # SmolLM2 drafts with its shipped EAGLE head: llama.cpp gets no draft model
    assert bench.llama_cpp_ggufs(job_for("--model", SMOLLM2, "--also-llama-cpp"))[1] is None
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text("{}")
    (head / "model.safetensors").write_bytes(b"")
    job = job_for("--model", QWEN, "--ea-model-path", str(head), "--also-llama-cpp")
    assert bench.llama_cpp_ggufs(job)[1] is None


def test_explicit_gguf_files(fetched, tmp_path):
    target, draft = tmp_path / "t.gguf", tmp_path / "d.gguf"
    target.write_bytes(b"x")
    draft.write_bytes(b"y")
    job = job_for("--model", QWEN, "--also-llama-cpp", str(target), "--llama-cpp-draft", str(draft))
    assert bench.llama_cpp_ggufs(job) == (str(target), str(draft)) and fetched == []


def test_bad_gguf_arguments_are_clear_errors(fetched, tmp_path):
    (tmp_path / "config.json").write_text("{}")  # a model folder, not a preset
    with pytest.raises(SystemExit, match="is not a preset.*--also-llama-cpp PATH.gguf"):
        bench.llama_cpp_ggufs(job_for("--model", str(tmp_path), "--also-llama-cpp"))
    missing = tmp_path / "nope.gguf"
    with pytest.raises(SystemExit, match="nope.gguf.*no such file.*preset name"):
        bench.llama_cpp_ggufs(job_for("--model", QWEN, "--also-llama-cpp", str(missing)))
    with pytest.raises(SystemExit, match="--llama-cpp-draft.*no such file"):
        bench.llama_cpp_ggufs(job_for("--model", QWEN, "--also-llama-cpp", "--llama-cpp-draft", str(missing)))


def test_missing_llama_cpp_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails as if not installed
    with pytest.raises(SystemExit, match="llama-cpp-python.*pip install llama-cpp-python"):
        llama_cpp_peer.open_gguf("model.gguf", 2, 256)


def test_bench_fails_before_loading_anything(fetched, tmp_path, monkeypatch):
    def no_run(job):
        raise AssertionError("bench loaded models before checking the llama.cpp arguments")
    monkeypatch.setattr(bench, "run", no_run)
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    with pytest.raises(SystemExit, match="pip install llama-cpp-python"):
        bench.main(["--model", QWEN, "--also-llama-cpp"])
    monkeypatch.setattr(bench, "import_llama_cpp", lambda: None)
    with pytest.raises(SystemExit, match="nope.gguf.*no such file"):
        bench.main(["--model", QWEN, "--also-llama-cpp", str(tmp_path / "nope.gguf")])


def test_a_llama_cpp_build_that_crashes_is_named_before_the_bench_runs(tmp_path, monkeypatch):
    """A child process runs llama.cpp's first forward: a crash there (as a native AMX build under gcc 12 does)
    becomes an error naming the rebuild, and the bench loads nothing."""
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(llama_cpp_peer, "SMOKE_TEST", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    with pytest.raises(SystemExit, match=r"crashed \(signal 11\).*model.gguf.*without AMX"):
        llama_cpp_peer.smoke_test(str(gguf))
    monkeypatch.setattr(bench, "import_llama_cpp", lambda: None)
    monkeypatch.setattr(bench, "llama_cpp_ggufs", lambda job: (str(gguf), None))

    def no_run(job):
        raise AssertionError("bench loaded models before llama.cpp's smoke test")
    monkeypatch.setattr(bench, "run", no_run)
    with pytest.raises(SystemExit, match="without AMX"):
        bench.main(["--model", QWEN, "--also-llama-cpp"])
    monkeypatch.setattr(llama_cpp_peer, "SMOKE_TEST", "import sys; sys.exit('unknown model architecture')")
    with pytest.raises(SystemExit, match="llama.cpp failed on .*model.gguf: unknown model architecture"):
        llama_cpp_peer.smoke_test(str(gguf))


# --- with llama.cpp and the SmolLM2 GGUF ---------------------------------------------------------------------------

needs_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None or not gguf_path(SMOLLM2).is_file(),
    reason="needs llama-cpp-python and `eagle-fsd models gguf smollm2-135m-instruct` (README, Compare with llama.cpp)")


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle_fsd.presets import resolve_model
    from eagle_fsd.prompts import PromptFormat
    folder = resolve_model(SMOLLM2, fetch_missing=False)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = PromptFormat(tokenizer).encode([{"role": "user", "content": "Name three uses of a paperclip."}])
    return model, ids, str(gguf_path(SMOLLM2))


@needs_llama_cpp
def test_same_prompt_ids_reach_llama_cpp(smollm2):
    """llama.cpp's logits on the preset's GGUF track HF's on the folder converted from it, position by position:
    the prompt's ids arrive unchanged (no BOS added, same vocabulary); the gap is llama.cpp's 8-bit activations."""
    import numpy as np
    model, ids, gguf = smollm2
    llm = llama_cpp_peer.open_gguf(gguf, 2, 256, logits_all=True)
    llm.eval(ids[0].tolist())
    theirs = torch.from_numpy(np.array(llm.scores[:llm.n_tokens]))
    with torch.no_grad():
        ours = model(ids).logits[0]
    assert theirs.shape == ours.shape
    assert (theirs.argmax(-1) == ours.argmax(-1)).float().mean() >= 0.9
    assert (theirs - ours).abs().max() < 0.1 * ours.abs().max()


@needs_llama_cpp
def test_greedy_row_stops_at_the_limit_and_at_a_stop_token(smollm2):
    _, ids, gguf = smollm2
    llm = llama_cpp_peer.open_gguf(gguf, 2, 256)
    n = ids.shape[1]
    full = llama_cpp_peer.greedy_method(llm, 12, set())(ids)["sequences"][0, n:].tolist()
    assert len(full) == 12
    again = llama_cpp_peer.greedy_method(llm, 12, set())(ids)["sequences"][0, n:].tolist()
    assert again == full  # a cleared cache each run: the same tokens
    stop = full[4]
    cut = llama_cpp_peer.greedy_method(llm, 12, {stop})(ids)["sequences"][0, n:].tolist()
    assert cut == full[:full.index(stop) + 1]  # the stop token is kept, as HF generate keeps it


@needs_llama_cpp
def test_draft_hook_proposes_the_greedy_continuation_after_any_prefix(smollm2):
    """A GGUF drafting for itself proposes exactly its own next greedy tokens, whatever prefix it is called with:
    longer (catch-up), shorter (the target rejected drafts) or a different last token."""
    _, ids, gguf = smollm2
    n, k = ids.shape[1], 3
    plain = llama_cpp_peer.greedy_method(llama_cpp_peer.open_gguf(gguf, 2, 256), 24, set())(ids)[
        "sequences"][0].tolist()
    draft = llama_cpp_peer.GreedyDraft(llama_cpp_peer.open_gguf(gguf, 2, 256), k)
    for cut in (n, n + 6, n + 3, n + 12, n + 11):
        proposed = draft(plain[:cut]).tolist()
        assert proposed == plain[cut:cut + k], cut
    assert draft.calls == 5


@needs_llama_cpp
def test_draft_row_counts_target_forwards(smollm2):
    """With a draft model, tokens per target forward (prefill included) is above 1 and at most K + 1."""
    _, ids, gguf = smollm2
    methods = llama_cpp_peer.llama_cpp_methods(gguf, gguf, 2, 256, 24, set(), 3)
    out = methods["llama.cpp draft K=3"](ids)
    new = out["sequences"].shape[1] - ids.shape[1]
    assert new == 24
    assert 1 < new / out["target_forwards"] <= 4


@needs_llama_cpp
def test_smoke_test_passes_on_a_working_build():
    assert llama_cpp_peer.smoke_test(str(gguf_path(SMOLLM2))) is None
