"""Interactive chat with live speculative-decoding statistics.

    eagle-fsd chat --model qwen2.5-coder-1.5b-instruct [--fsd-threshold 0.5]
    eagle-fsd chat --model qwen2.5-coder-1.5b-instruct --prompt "Write a haiku"   # one reply, for scripts
    echo "Write a haiku" | eagle-fsd chat --prompt -

Replies stream as they are decoded; the conversation is kept as chat history. After each reply: tokens/s, tau
(tokens per target forward) and the fuzzy fraction (share of accepted draft tokens only FSD accepted); at a terminal
the tokens only FSD accepted show in yellow (--color). Ctrl-C stops
the current reply and keeps what was written of it; at the prompt, Ctrl-C clears the line and Ctrl-D leaves.

Commands: /fsd T | /fsd off, /divergence NAME, /temp X, /reset, /stats, /help, /quit
"""
from __future__ import annotations

import argparse
import signal
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace

from transformers import TextStreamer

from eagle_fsd.tree.accept import tokens_per_step
from eagle_fsd.fsd import DIVERGENCES
from eagle_fsd.prompts import PromptFormat, generate_reply
from eagle_fsd.model import load_model
from eagle_fsd.settings import Settings, add_fsd_args, add_model_args, parse_settings

COMMANDS_HELP = """commands:
  /fsd T          fuzzy acceptance with threshold T (>= 0)      /fsd off   lossless again
  /divergence N   FSD divergence, one of: {divergences}
  /temp X         sampling temperature (0 = greedy)
  /reset          forget the conversation          /stats   session statistics and settings
  /help           this text                         /quit    leave"""


class ReplyInterrupted(Exception):
    """Raised inside generation (by the streamer) when the user pressed Ctrl-C."""


class InterruptFlag:
    """SIGINT while a reply is generating asks it to stop at the next decoding step (the streamer checks the flag);
    a second one, or one while idle, is an ordinary KeyboardInterrupt."""

    def __init__(self):
        self.generating = False
        self.requested = False

    def handler(self, signum, frame):
        if self.generating and not self.requested:
            self.requested = True
            return
        raise KeyboardInterrupt

    @contextmanager
    def installed(self):
        previous = signal.signal(signal.SIGINT, self.handler)
        try:
            yield self
        finally:
            signal.signal(signal.SIGINT, previous)


FUZZY_STYLE, RESET_STYLE = "\x1b[33m", "\x1b[0m"  # fuzzily accepted tokens print in yellow


class ChatStreamer(TextStreamer):
    """Prints the reply as it decodes, keeps its token ids, and stops generation when interrupted.

    With colour on, it prints token by token and wraps the text of each token that only the FSD rule accepted in
    FUZZY_STYLE (the engine hands over the flags through put_fuzzy_mask)."""

    def __init__(self, tokenizer, out, flag: InterruptFlag, colour: bool = False):
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.out, self.flag, self.ids, self.colour = out, flag, [], colour
        self.fuzzy: list[bool] = []  # per reply token
        self._next_fuzzy: list[bool] = []
        # Text is decoded from `_line_start` (the token after the last printed newline), so each token costs one
        # decode of its line, not of the whole reply; `_shown_chars` counts what of that line is printed.
        self._shown_tokens = self._line_start = self._shown_chars = 0

    def put_fuzzy_mask(self, mask: list[bool]) -> None:
        self._next_fuzzy = list(mask)

    def put(self, value):
        if self.flag.requested:
            raise ReplyInterrupted
        if self.next_tokens_are_prompt:
            return super().put(value)
        new = value.reshape(-1).tolist()
        mask = self._next_fuzzy if len(self._next_fuzzy) == len(new) else [False] * len(new)
        self.ids.extend(new)
        self.fuzzy.extend(mask)
        self._next_fuzzy = []
        if self.colour:
            self._show(final=False)
        else:
            super().put(value)

    def _show(self, final: bool) -> None:
        """Print the text of the tokens not shown yet, one token at a time; a token whose text ends in an
        incomplete character waits for the next one (unless final)."""
        pieces = []
        for i in range(self._shown_tokens, len(self.ids)):
            text = self.tokenizer.decode(self.ids[self._line_start: i + 1], **self.decode_kwargs)
            if text.endswith("\ufffd") and not final:
                break
            piece = text[self._shown_chars:]
            pieces.append(f"{FUZZY_STYLE}{piece}{RESET_STYLE}" if self.fuzzy[i] and piece else piece)
            self._shown_tokens, self._shown_chars = i + 1, len(text)
            if text.endswith("\n"):
                self._line_start, self._shown_chars = i + 1, 0
        if pieces:
            self.out.write("".join(pieces))
            self.out.flush()

    def end(self):
        if not self.colour:
            return super().end()
        self._show(final=True)
        self.out.write("\n")
        self.out.flush()
        self.next_tokens_are_prompt = True

    def on_finalized_text(self, text: str, stream_end: bool = False):
        self.out.write(text + ("\n" if stream_end else ""))
        self.out.flush()


class Totals:
    """Session sums for /stats (interrupted replies count tokens and time, not steps)."""

    def __init__(self):
        self.replies = self.tokens = self.steps = self.accepted = self.fuzzy = 0
        self.seconds = 0.0

    def add(self, out) -> None:
        self.replies += 1
        self.tokens += out.new_tokens
        self.seconds += out.wall_time
        self.steps += out.verify_steps
        self.accepted += sum(out.accept_lengths)
        self.fuzzy += sum(out.fuzzy_accepts)

    def line(self) -> str:
        tps = self.tokens / self.seconds if self.seconds else 0.0
        tau = tokens_per_step(self.accepted, self.steps)
        fuzzy = self.fuzzy / self.accepted if self.accepted else 0.0
        return (f"{self.replies} replies, {self.tokens} tokens in {self.seconds:.2f} s = {tps:.2f} tokens/s, "
                f"tau {tau:.2f}, fuzzy fraction {fuzzy:.2f}")


def reply_stats(out) -> str:
    tps = out.new_tokens / out.wall_time if out.wall_time else 0.0
    return (f"[{out.new_tokens} tokens, {tps:.2f} tokens/s, tau {out.tau:.2f}, "
            f"fuzzy fraction {out.fuzzy_fraction:.2f}]")


@dataclass(frozen=True)
class ChatOptions:
    """`eagle-fsd chat`: the settings, a system message, one --prompt for scripts ('-': stdin), and when to colour
    the fuzzily accepted tokens (auto: at a terminal)."""

    settings: Settings
    system: str | None = None
    prompt: str | None = None
    color: str = "auto"


class ChatSession:
    """A conversation (history through the chat template) plus the generation and FSD settings the slash commands
    change.

    out: where replies stream; info: where statistics and command answers go; colour: always, never or auto."""

    def __init__(self, model, fmt: PromptFormat, settings: Settings, out=sys.stdout, info=None, colour="never"):
        self.model, self.fmt = model, fmt
        self.generation, self.fsd = settings.generation, settings.fsd
        self.out, self.info = out, info or out
        self.messages: list[dict] = []
        self.totals = Totals()
        self.flag = InterruptFlag()
        self.colour = colour == "always" or (colour == "auto" and out.isatty())

    def say(self, text: str) -> None:
        self.info.write(text + "\n")
        self.info.flush()

    # ------------------------------------------------------------ settings
    def settings_line(self) -> str:
        gen, fsd = self.generation, self.fsd
        mode = "plain decoding" if gen.baseline else (
            "lossless" if fsd.threshold is None else f"FSD {fsd.divergence} T={fsd.threshold:g} ({fsd.mode})")
        return f"{mode}, temperature {gen.temperature:g}, max {gen.max_new_tokens} new tokens"

    def command(self, line: str) -> bool:
        """Run a slash command; False when the session should end."""
        name, _, value = line[1:].strip().partition(" ")
        value = value.strip()
        if name in ("quit", "exit", "q"):
            return False
        handler = {"fsd": self.set_fsd, "divergence": self.set_divergence, "temp": self.set_temperature,
                   "reset": self.reset, "stats": self.stats, "help": self.help}.get(name)
        if handler is None:
            self.say(f"unknown command /{name}; /help lists them")
        else:
            handler(value)
        return True

    def set_fsd(self, value: str) -> None:
        if value == "off":
            self.fsd = replace(self.fsd, threshold=None)
        else:
            try:
                self.fsd = replace(self.fsd, threshold=float(value))
            except ValueError:
                self.say(f"/fsd {value!r}: expected a threshold >= 0 (e.g. /fsd 0.5) or /fsd off")
                return
        if self.generation.baseline:
            self.say("note: --baseline runs plain decoding; FSD settings apply without it")
        self.say(self.settings_line())

    def set_divergence(self, value: str) -> None:
        if value not in DIVERGENCES:
            self.say(f"/divergence {value!r}: expected one of {', '.join(DIVERGENCES)}")
            return
        self.fsd = replace(self.fsd, divergence=value)
        self.say(self.settings_line())

    def set_temperature(self, value: str) -> None:
        try:
            temperature = float(value)
            if not temperature >= 0:
                raise ValueError
        except ValueError:
            self.say(f"/temp {value!r}: expected a number >= 0 (0 = greedy)")
            return
        self.generation = replace(self.generation, temperature=temperature)
        self.say(self.settings_line())

    def reset(self, _value: str = "") -> None:
        self.messages.clear()
        self.say("conversation cleared")

    def stats(self, _value: str = "") -> None:
        self.say(f"session: {self.totals.line()}\nsettings: {self.settings_line()}; "
                 f"{len(self.messages) // 2} exchanges in the history")

    def help(self, _value: str = "") -> None:
        self.say(COMMANDS_HELP.format(divergences=", ".join(DIVERGENCES)))

    # ------------------------------------------------------------ replies
    def reply(self, text: str) -> str | None:
        """Stream the model's reply to `text`; it joins the history even when cut short by Ctrl-C."""
        self.messages.append({"role": "user", "content": text})
        ids = self.fmt.encode(self.messages)
        streamer = ChatStreamer(self.model.tokenizer, self.out, self.flag, colour=self.colour)
        self.flag.generating, self.flag.requested = True, False
        start = time.perf_counter()
        try:
            out = generate_reply(self.model, ids, self.generation, self.fsd, self.fmt, streamer=streamer)
        except (ReplyInterrupted, KeyboardInterrupt):
            return self._keep_partial(streamer, time.perf_counter() - start)
        except ValueError as err:  # e.g. the history outgrew the model's context
            self.messages.pop()
            self.say(f"\nerror: {err}\n(/reset starts a new conversation)")
            return None
        finally:
            self.flag.generating = False
        answer = self.fmt.decode(out.sequences[0, ids.shape[1]:])
        self.messages.append({"role": "assistant", "content": answer})
        self.totals.add(out)
        self.say(reply_stats(out))
        return answer

    def _keep_partial(self, streamer: ChatStreamer, seconds: float) -> str:
        partial = self.fmt.decode(streamer.ids)
        streamer.end()  # prints what the streamer still held back, and a newline
        self.messages.append({"role": "assistant", "content": partial})
        self.totals.replies += 1
        self.totals.tokens += len(streamer.ids)
        self.totals.seconds += seconds
        self.say(f"[interrupted after {len(streamer.ids)} tokens; the partial reply stays in the conversation]")
        return partial


def run_lines(session: ChatSession, lines, prompt: str | None = None) -> int:
    """The chat loop over input lines (stdin, or a list in tests): messages, and slash commands."""
    lines = iter(lines)
    while True:
        if prompt is not None:
            session.out.write(prompt)
            session.out.flush()
        line = next(lines, None)
        if line is None:
            break
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            if not session.command(line):
                break
            continue
        session.reply(line)
    return 0


def interactive_lines():
    """Lines typed at a terminal (with line editing where readline exists)."""
    try:
        import readline  # noqa: F401  (input() gains history and editing)
    except ImportError:
        pass
    while True:
        try:
            yield input()
        except KeyboardInterrupt:  # Ctrl-C at the prompt: a fresh line, as in a shell
            print()
            yield ""
        except EOFError:
            print()
            return


def parse_args(argv) -> ChatOptions:
    p = argparse.ArgumentParser(prog="eagle-fsd chat", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, max_new_flag=("--max-new-tokens", "--max-new-token"), max_new_default=512)
    add_fsd_args(p)
    p.add_argument("--system", default=None, help="system message (default: the chat template's)")
    p.add_argument("--prompt", default=None, help="answer this one message and exit ('-': read it from stdin)")
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                   help="show fuzzily accepted tokens in yellow (auto: when writing to a terminal)")
    args = p.parse_args(argv)
    return ChatOptions(parse_settings(p, args), args.system, args.prompt, args.color)


def run(model, options: ChatOptions, stdin=None, stdout=None, stderr=None) -> int:
    """Chat with a loaded model: one --prompt, or lines from stdin (interactive at a terminal)."""
    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    settings = options.settings
    fmt = PromptFormat(model.tokenizer, settings.model.conv_template, options.system)
    if options.prompt is not None:
        # Scripts: the reply on stdout, the statistics on stderr (so `$(eagle-fsd chat --prompt ...)` is the reply).
        session = ChatSession(model, fmt, settings, out=stdout, info=stderr, colour=options.color)
        text = stdin.read() if options.prompt == "-" else options.prompt
        with session.flag.installed():
            return 0 if session.reply(text.strip()) is not None else 1
    session = ChatSession(model, fmt, settings, out=stdout, colour=options.color)
    tty = stdin.isatty()
    if tty:
        session.say(f"{settings.model.model}: {session.settings_line()}. /help for commands, Ctrl-D to leave.")
    with session.flag.installed():
        return run_lines(session, interactive_lines() if tty and stdin is sys.stdin else stdin,
                         prompt=">>> " if tty else None)


def main(argv=None) -> int:
    options = parse_args(sys.argv[1:] if argv is None else argv)
    model = load_model(options.settings)
    return run(model, options)


if __name__ == "__main__":
    raise SystemExit(main())
