"""Building the C++ kernels with torch.utils.cpp_extension so that a killed build cannot hang the next one.

torch marks a build in progress with an empty `lock` file in its build folder, and a second process waits for that
file to vanish, without end. A process killed while it builds (Ctrl-C, a time limit, a machine stopped) leaves the
file behind and every later load of the kernel waits forever. Here each load first takes an OS lock (flock) on a file
beside the build folder: the kernel drops it when its holder dies, so whoever holds it knows that no build of ours is
running, and a `lock` file it finds is stale and goes.

Build folders: `$TORCH_EXTENSIONS_DIR` (else torch's default root) / NAME-pyXY-torchVERSION, one per Python and torch.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import sys
from collections.abc import Iterator
from pathlib import Path


def build_folder(name: str) -> Path:
    """Where extension `name` is built for this Python and this torch."""
    import torch
    from torch.utils import cpp_extension
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    return Path(root) / f"{name}-py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}"


@contextlib.contextmanager
def exclusive_build_folder(name: str) -> Iterator[Path]:
    """The build folder of `name`, held against our other processes, with a dead build's `lock` file removed."""
    folder = build_folder(name)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(folder.name + ".flock"), "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # released by the OS when this process ends, however it ends
        try:
            (folder / "lock").unlink(missing_ok=True)  # torch's baton: ours would hold the flock, so it is dead
            yield folder
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)


def load_extension(name: str, source: Path, cflags: list[str], ldflags: list[str]):
    """The Python module built from one C++ `source` (compiled on first use, then cached in `build_folder(name)`)."""
    from torch.utils import cpp_extension
    with exclusive_build_folder(name) as folder:
        return cpp_extension.load(name=name, sources=[str(source)], extra_cflags=cflags, extra_ldflags=ldflags,
                                  build_directory=str(folder), verbose=False)
