"""Low-level file helpers shared by every layer (imports nothing of ours): where the per-machine cache lives, the
sha256 of a file, atomic text writes and data files shipped inside installed packages."""
from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

CHUNK = 1 << 20  # read/copy block size (1 MiB)


def cache_dir() -> Path:
    """Root of the per-machine cache: ``$EAGLE_FSD_CACHE``, else ``~/.cache/eagle-fsd``."""
    env = os.environ.get("EAGLE_FSD_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "eagle-fsd"


def byte_bar(progress: bool, total: int, desc: str):
    """A byte-counting tqdm bar, or a do-nothing stand-in when progress is off."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress)


def sha256_file(path: Path, progress: bool = False) -> str:
    """Hex sha256 of a file, read in blocks (with a progress bar for the big GGUFs)."""
    h = hashlib.sha256()
    with open(path, "rb") as f, byte_bar(progress, Path(path).stat().st_size, "checking sha256") as bar:
        while block := f.read(CHUNK):
            h.update(block)
            bar.update(len(block))
    return h.hexdigest()


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to a temp file beside ``path`` and rename it into place: readers see the old or the new file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def package_file(package: str, relative: str, install: str, sha256: str | None = None) -> Path:
    """A data file shipped inside an installed package, found without importing the package (data packages pull
    heavy or missing dependencies on import), with its sha256 checked when one is given."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{package} is not installed; run `{install}`")
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with `{install}`")
    if sha256 is not None and (digest := sha256_file(path)) != sha256:
        raise ValueError(f"{path} has sha256 {digest}, expected {sha256}; reinstall with `{install}`")
    return path
