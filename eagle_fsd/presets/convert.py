"""GGUF -> plain Hugging Face folder (config.json + model.safetensors + tokenizer files), converted in a child
process and verified against the GGUF-loaded model: same token ids, chat-template text, eos and (up to float noise)
logits."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from eagle_fsd.presets.registry import CHAT_EOS, Preset, PresetError
from eagle_fsd.presets.wheels import run_child


def convert_gguf(preset: Preset, gguf: Path, out_dir: Path, progress: bool) -> None:
    """Convert the GGUF into a plain HF folder at ``out_dir`` in a child Python process.

    A child process keeps the caller's memory clean (converting the 1.5B peaks at ~6 GB,
    which a long-lived process would not give back) and lets us set HF_HUB_OFFLINE=1 before
    transformers is imported there.
    """
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    # Make the child find this package even when it is not installed.
    pkg_parent = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [pkg_parent, env.get("PYTHONPATH")]))
    code = "import sys; from eagle_fsd.presets.convert import convert_here; convert_here(*sys.argv[1:])"
    cmd = [sys.executable, "-c", code, str(gguf), str(out_dir), preset.save_dtype]
    proc = run_child(cmd, progress, env=env)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout or "").strip().splitlines()[-20:]) or "(see the messages above)"
        raise PresetError(
            f"{preset.name}: converting {gguf} to a Hugging Face folder failed (exit code {proc.returncode}).\n"
            f"{tail}\n"
            "Fix: check free RAM (the 1.5B needs ~6 GB) and that gguf, accelerate and transformers>=5 "
            "are installed, then run the fetch again."
        )


# --------------------------------------------------------------------------------------
# Conversion proper (runs inside the child process started by convert_gguf)
# --------------------------------------------------------------------------------------

# Short texts used to check that the saved folder reproduces the GGUF model and tokenizer.
_PROBE_TEXT = "The capital of France is Paris. def add(a, b): return a + b  # 12345"
_PROBE_CHAT = [{"role": "user", "content": "Write hello world in Python."}]


def plain_copy(gguf_model):
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


def generation_eos_ids(gen) -> list[int]:
    """The eos ids of a generation config as a list, in its order (an int, a list or None)."""
    eos = gen.eos_token_id
    return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))


def fix_chat_eos(tok, model) -> int:
    """Check ``<|im_end|>`` is the tokenizer's eos and make it a generation_config eos id."""
    im_end = tok.convert_tokens_to_ids(CHAT_EOS)
    if im_end is None or im_end == tok.unk_token_id:
        raise PresetError(f"tokenizer has no {CHAT_EOS} token")
    if tok.eos_token != CHAT_EOS:
        raise PresetError(f"tokenizer eos is {tok.eos_token!r}, expected {CHAT_EOS!r}")
    eos_ids = generation_eos_ids(model.generation_config)
    if im_end not in eos_ids:
        print(f"[eagle-fsd] note: adding {CHAT_EOS}={im_end} to the eos ids {eos_ids}", file=sys.stderr)
        model.generation_config.eos_token_id = [im_end, *eos_ids] if eos_ids else im_end
    return im_end


def convert_here(gguf: str, out_dir: str, dtype_name: str) -> None:
    """Load ``gguf`` with transformers, save it as a plain HF folder and verify the result.

    Raises if the saved folder does not give the same token ids, chat-template text, eos and
    (up to float noise) logits as the GGUF-loaded model.
    """
    import gc

    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    from eagle_fsd.dtypes import torch_dtype

    dtype = torch_dtype(dtype_name)
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
    im_end = fix_chat_eos(tok, model)
    # GGUF tokenizers come without a length limit; use the model's context, as upstream does.
    tok.model_max_length = model.config.max_position_embeddings

    probe_ids, chat_text, ref_logits = reference_outputs(tok, model)

    plain = plain_copy(model)
    plain.save_pretrained(out)
    tok.save_pretrained(out)
    # Free the GGUF model (and the plain copy sharing its tensors) before reloading.
    del model, plain
    gc.collect()

    verify_saved(out, dtype, probe_ids, ref_logits, chat_text, im_end)
    print(f"[eagle-fsd] converted and verified in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)


def reference_outputs(tok, model):
    """(probe token ids, probe chat text, probe logits) of the GGUF-loaded tokenizer and model, kept to check the
    saved folder against."""
    import torch

    probe_ids = tok(_PROBE_TEXT, return_tensors="pt").input_ids
    chat_text = tok.apply_chat_template(_PROBE_CHAT, tokenize=False, add_generation_prompt=True)
    with torch.no_grad():
        ref_logits = model(probe_ids).logits.float()
    return probe_ids, chat_text, ref_logits


def verify_saved(out: Path, dtype, probe_ids, ref_logits, chat_text: str, im_end: int) -> None:
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
    saved_eos = generation_eos_ids(model.generation_config)
    if im_end not in saved_eos:
        raise PresetError(f"saved generation_config eos ids {saved_eos} lack {CHAT_EOS}={im_end}")
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
