"""kernels/cpp_build.py: a build killed mid-way leaves torch's `lock` file behind; the next load must clear it, not
wait on it forever, and must still wait for a build that is alive. A one-line C source stands in for the kernels
(compiled in well under a second), loaded by the real torch.utils.cpp_extension in fresh processes."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from eagle_fsd.kernels.cpp_build import build_folder, exclusive_build_folder

NAME = "eagle_fsd_test_answer"
SOURCE = 'extern "C" int eagle_fsd_answer() { return 42; }\n'


@pytest.fixture
def extensions_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    (tmp_path / "answer.cpp").write_text(SOURCE)
    return tmp_path


def run_python(code: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kwargs)


def test_a_killed_builds_lock_is_cleared(extensions_dir):
    """What a build killed mid-way leaves (torch's baton, nobody holding the flock) does not stop the next load."""
    folder = build_folder(NAME)
    folder.mkdir(parents=True)
    (folder / "lock").touch()
    proc = run_python(f"""
        import ctypes
        from torch.utils import cpp_extension
        from eagle_fsd.kernels.cpp_build import exclusive_build_folder
        with exclusive_build_folder({NAME!r}) as folder:
            path = cpp_extension.load({NAME!r}, [{str(extensions_dir / "answer.cpp")!r}], build_directory=str(folder),
                                      is_python_module=False)
        print("answer", ctypes.CDLL(path).eagle_fsd_answer())
    """)
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the load waited on the dead build's lock file")
    assert proc.returncode == 0, out
    assert "answer 42" in out
    assert not (folder / "lock").exists()


def test_a_live_build_is_waited_for(extensions_dir):
    """While one process builds (holds the folder, its baton present), another waits and leaves the baton alone;
    it goes on once the first is done."""
    entered = extensions_dir / "entered"
    ready = extensions_dir / "ready"
    with exclusive_build_folder(NAME) as folder:
        (folder / "lock").touch()  # the live build's baton
        proc = run_python(f"""
            from pathlib import Path
            from eagle_fsd.kernels.cpp_build import exclusive_build_folder
            Path({str(ready)!r}).touch()
            with exclusive_build_folder({NAME!r}):
                Path({str(entered)!r}).touch()
        """)
        deadline = time.monotonic() + 120
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready.exists(), proc.communicate()[0]
        time.sleep(2.0)
        assert not entered.exists(), "a second process went into a folder that a live build holds"
        assert (folder / "lock").exists(), "a live build's lock file was removed"
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert entered.exists()
    assert not (folder / "lock").exists()  # left behind by the first, then cleared by the second
