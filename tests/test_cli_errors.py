"""CLI input errors that must fail at once, in one line, before any model is loaded (no weights, no network)."""
import time

import pytest

from eagle_fsd import cli, model, presets, settings
from eagle_fsd.model import EaFsdModel

UNKNOWN = "no-such-org/no-such-model"


@pytest.fixture
def no_hub(monkeypatch, tmp_path):
    """An empty Hugging Face cache and no offline flags set; tests choose how the hub behaves."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)


@pytest.fixture
def no_model_loading(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded although the arguments are invalid")

    monkeypatch.setattr(model, "load_model", refuse)
    monkeypatch.setattr(EaFsdModel, "from_pretrained", refuse)


def check_unknown_model_message(message):
    assert "\n" not in message.strip()
    assert repr(UNKNOWN) in message and "a hub id needs the network" in message
    assert all(name in message for name in presets.PRESETS)


def test_unknown_model_with_hf_hub_offline_fails_without_a_probe(no_hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(presets.hub, "hub_reachable", lambda *a, **k: pytest.fail("HF_HUB_OFFLINE is set: no probe"))
    start = time.perf_counter()
    with pytest.raises(FileNotFoundError) as err:
        presets.resolve_model(UNKNOWN)
    assert time.perf_counter() - start < 5
    check_unknown_model_message(str(err.value))
    assert "HF_HUB_OFFLINE" in str(err.value)


def test_unknown_model_with_an_unreachable_hub_fails_fast(no_hub, monkeypatch):
    """A real probe against an address that never answers (TEST-NET-1, RFC 5737): bounded by HUB_PROBE_SECONDS."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://192.0.2.1")
    start = time.perf_counter()
    with pytest.raises(FileNotFoundError) as err:
        presets.resolve_model(UNKNOWN)
    assert time.perf_counter() - start < 5
    check_unknown_model_message(str(err.value))
    assert "http://192.0.2.1" in str(err.value)


def test_hub_ids_pass_when_cached_or_reachable(no_hub, monkeypatch, tmp_path):
    monkeypatch.setattr(presets.hub, "hub_reachable", lambda *a, **k: True)
    assert presets.resolve_model(UNKNOWN) == UNKNOWN  # transformers takes it from here
    # offline, but the local HF cache holds the repo's config.json: transformers loads it from there
    monkeypatch.setattr(presets.hub, "hub_reachable", lambda *a, **k: False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = tmp_path / "hf-cache" / "models--no-such-org--no-such-model"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    (repo / "snapshots" / ("0" * 40)).mkdir(parents=True)
    (repo / "snapshots" / ("0" * 40) / "config.json").write_text("{}")
    assert presets.resolve_model(UNKNOWN) == UNKNOWN
    local = tmp_path / "local-model"
    local.mkdir()
    assert presets.resolve_model(str(local)) == str(local)  # a local folder is never checked against the hub


def test_cli_run_with_an_unknown_model_prints_one_line(no_hub, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    assert cli.main(["run", "--model", UNKNOWN, "--dtype", "fp32"]) == 2
    assert time.perf_counter() - start < 5
    err = capsys.readouterr().err
    assert err.startswith("eagle-fsd run: error: model ") and err.count("\n") == 1
    check_unknown_model_message(err)


@pytest.mark.parametrize("flag", ["--total-token", "--depth", "--top-k"])
@pytest.mark.parametrize("value", ["0", "-3", "two"])
def test_cli_run_rejects_a_non_positive_tree_setting(no_model_loading, capsys, flag, value):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["run", flag, value])
    assert exit_.value.code == 2  # argparse's usage error
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and repr(value) in err and "positive int or 'auto'" in err


def test_flags_become_typed_settings():
    s, _ = cli.parse_run_args(["--model", "m", "--drafter", "d", "--total-token", "12", "--depth", "auto",
                               "--max-new-tokens", "7", "--temperature", "0.5", "--fsd-threshold", "0.3",
                               "--fsd-divergence", "tv", "--fsd-mode", "original"])
    assert s.model == settings.ModelSettings("m", "d", None, "auto", "auto", None, None)
    assert s.tree == settings.TreeSettings(12, "auto", "auto", None)
    pinned, _ = cli.parse_run_args(["--total-token", "5", "--depth", "1", "--top-k", "4", "--draft-vocab", "37888"])
    assert pinned.tree == settings.TreeSettings(5, 1, 4, 37888)

    assert s.generation == settings.GenerationSettings(7, 0.5, 1.0, 0, baseline=False)
    assert (s.fsd.threshold, s.fsd.divergence, s.fsd.mode) == (0.3, "tv", "original")


@pytest.mark.parametrize("value", ["-1", "many"])
def test_cli_run_rejects_a_bad_draft_vocab(no_model_loading, capsys, value):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["run", "--draft-vocab", value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --draft-vocab" in err and repr(value) in err and "0 = the full vocabulary" in err


@pytest.mark.parametrize("argv, message", [
    (["--max-new-tokens", "-5"], "max_new_tokens=-5 must be a positive int"),
    (["--max-new-tokens", "0"], "max_new_tokens=0 must be a positive int"),
    (["--temperature", "-0.5"], "temperature=-0.5 must be a number >= 0"),
    (["--top-p", "1.5"], "top_p=1.5 must be in (0, 1]"),
])
def test_cli_run_rejects_bad_sampling_flags_before_loading(no_model_loading, capsys, argv, message):
    start = time.perf_counter()
    with pytest.raises(SystemExit) as exit_:
        cli.main(["run", *argv])
    assert exit_.value.code == 2 and time.perf_counter() - start < 10
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("flag", ["--ea-model-path", "--drafter", "--model"])
def test_cli_run_rejects_a_folder_without_config_before_loading(no_model_loading, capsys, tmp_path, flag):
    empty = tmp_path / "head"
    empty.mkdir()
    with pytest.raises(SystemExit) as exit_:
        cli.main(["run", flag, str(empty)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"{flag} {empty}: the directory has no config.json" in err


def test_a_bad_head_fails_before_the_target_loads(tmp_path, monkeypatch):
    """From Python too: the head is looked at before the (large) target is read."""
    from eagle_fsd import loading

    def refuse(*args, **kwargs):
        raise AssertionError("the target was loaded before the head was checked")

    monkeypatch.setattr(loading, "load_target", refuse)
    empty = tmp_path / "head"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        EaFsdModel.from_pretrained("smollm2-135m-instruct", ea_model_path=str(empty), total_token=4, depth=1,
                                   top_k=2, dtype="fp32")
