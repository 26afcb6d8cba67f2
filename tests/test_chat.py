"""`eagle-fsd chat` driven through stdin on a tiny random model with the SmolLM2 tokenizer: replies and their
statistics, slash commands, history through the chat template, --prompt for scripts, and Ctrl-C mid-reply."""
import io
import re
import signal

import pytest
import torch

from eagle_fsd import chat, presets
from eagle_fsd.drafting import LMDrafter
from eagle_fsd.model import EaFsdModel
from eagle_fsd.prompts import PromptFormat
from tiny import tiny_model

torch.set_num_threads(1)
VOCAB = 49152  # SmolLM2's


@pytest.fixture(scope="module")
def model():
    if not presets.is_fetched("smollm2-135m-instruct"):
        pytest.skip("needs the SmolLM2 preset's tokenizer: eagle-fsd models fetch smollm2-135m-instruct")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(presets.resolve_model("smollm2-135m-instruct"))
    target = tiny_model(vocab=VOCAB, seed=1, max_position_embeddings=4096)
    drafter = tiny_model(vocab=VOCAB, seed=2, max_position_embeddings=4096, num_hidden_layers=1)
    return EaFsdModel(target, tokenizer, LMDrafter(drafter, VOCAB), total_token=8, depth=3, top_k=2)


def session(model, *argv, out=None):
    options = chat.parse_args(["--max-new-tokens", "8", *argv])
    return chat.ChatSession(model, PromptFormat(model.tokenizer), options.settings, out=out or io.StringIO(),
                            colour=options.color)


def test_chat_through_stdin_with_commands(model):
    stdin = io.StringIO("hello there\n/fsd 0.5\n/stats\nand again\n/divergence tv\n/temp 0\n/fsd nonsense\n"
                        "/fsd off\n/stats\n/nope\n/quit\nnever read\n")
    out = io.StringIO()
    assert chat.run(model, chat.parse_args(["--max-new-tokens", "8"]), stdin=stdin, stdout=out) == 0
    text = out.getvalue()
    # one statistics line per reply (the line after /quit is not read)
    assert len(re.findall(r"^\[8 tokens, [\d.]+ tokens/s, tau [\d.]+, fuzzy fraction", text, re.MULTILINE)) == 2
    assert "FSD kl_qp T=0.5 (reducible)" in text and "FSD tv T=0.5" in text
    assert "session: 1 replies" in text and "session: 2 replies" in text and "2 exchanges in the history" in text
    assert "/fsd 'nonsense': expected a threshold >= 0" in text and "unknown command /nope" in text
    assert "lossless, temperature 0" in text


def test_history_goes_through_the_chat_template(model):
    s = session(model)
    chat.run_lines(s, ["first question", "second question"])
    assert [m["role"] for m in s.messages] == ["user", "assistant", "user", "assistant"]
    prompt = model.tokenizer.decode(s.fmt.encode(s.messages[:3])[0])
    assert prompt.count("<|im_start|>user") == 2 and "first question" in prompt and "second question" in prompt
    s.command("/reset")
    assert s.messages == []


def test_fsd_changes_the_generation(model):
    s = session(model, "--fsd-threshold", "1000")
    chat.run_lines(s, ["count to ten"])
    assert s.totals.steps > 0 and s.totals.fuzzy > 0  # a huge T accepts the drafter's top guesses
    assert s.totals.tokens == 8


def test_colour_marks_exactly_the_fuzzy_tokens(model):
    s = session(model, "--fsd-threshold", "1000", "--color", "always", "--max-new-tokens", "12")
    chat.run_lines(s, ["count to ten"])
    streamed = s.out.getvalue().split("\n[12 tokens")[0]
    ids = model.tokenizer(s.messages[-1]["content"], add_special_tokens=False)["input_ids"]
    # without the colour codes, the stream is the reply; the yellow pieces are the texts of the fuzzy tokens
    assert streamed.replace(chat.FUZZY_STYLE, "").replace(chat.RESET_STYLE, "") == s.messages[-1]["content"]
    coloured = re.findall(re.escape(chat.FUZZY_STYLE) + "(.*?)" + re.escape(chat.RESET_STYLE), streamed, re.DOTALL)
    assert coloured and len(coloured) <= s.totals.fuzzy and ids
    plain = session(model, "--color", "never")  # lossless, no colour: no escape codes at all
    chat.run_lines(plain, ["count to ten"])
    assert "\x1b[" not in plain.out.getvalue()


def test_prompt_mode_for_scripts(model):
    out, err = io.StringIO(), io.StringIO()
    args = chat.parse_args(["--max-new-tokens", "6", "--prompt", "-"])
    assert chat.run(model, args, stdin=io.StringIO("a question from a pipe\n"), stdout=out, stderr=err) == 0
    assert out.getvalue().strip() and "tokens/s" not in out.getvalue()  # stdout: the reply only
    assert "tokens/s, tau" in err.getvalue() and "fuzzy fraction" in err.getvalue()


def test_ctrl_c_stops_the_reply_and_keeps_it(model, monkeypatch):
    s = session(model, "--max-new-tokens", "200")
    original_put, puts = chat.ChatStreamer.put, []

    def put_then_press_ctrl_c(self, value):
        puts.append(len(puts))
        if len(puts) == 4:  # the prompt and three decoding steps in: a real SIGINT to this process
            signal.raise_signal(signal.SIGINT)
        return original_put(self, value)

    monkeypatch.setattr(chat.ChatStreamer, "put", put_then_press_ctrl_c)
    with s.flag.installed():
        partial = s.reply("tell me a long story")
        assert 0 < len(puts) <= 6  # stopped at the next step, far before 200 tokens
        assert s.messages[-1] == {"role": "assistant", "content": partial}
        assert "[interrupted after" in s.out.getvalue()
        monkeypatch.setattr(chat.ChatStreamer, "put", original_put)
        s.reply("go on")  # the conversation continues after an interrupted reply
    assert len(s.messages) == 4 and not s.flag.generating
    assert signal.getsignal(signal.SIGINT) is not s.flag.handler  # the handler is removed afterwards


def test_bad_flags_fail_before_loading(capsys):
    with pytest.raises(SystemExit):
        chat.parse_args(["--fsd-threshold", "-1"])
    assert "fsd_threshold=-1.0 must be a number >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        chat.parse_args(["--fsd-divergence", "nope"])
    assert "'nope' is not one of" in capsys.readouterr().err
