"""What a model argument names: a preset (its fetched folder), a local directory, or a hub id, which is checked
at once (local HF cache, HF_HUB_OFFLINE, a short probe of the hub) so that an unusable name fails in seconds."""
from __future__ import annotations

import os
import threading
import urllib.error
import urllib.request

from eagle_fsd.presets.build import fetch
from eagle_fsd.presets.registry import PRESETS, PresetError, is_fetched, model_dir


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
            return str(model_dir(name_or_path))
        if not fetch_missing:
            raise PresetError(
                f"preset {name_or_path!r} is not fetched; run `eagle-fsd models fetch {name_or_path}`"
            )
        return str(fetch(name_or_path))
    if os.path.isdir(name_or_path):
        return name_or_path
    check_hub_id(name_or_path)
    return name_or_path


def serving_name(name_or_path: str) -> str:
    """How another engine (vLLM, SGLang) should name this model: a preset's hub repository, a directory's absolute
    path, a hub id as given."""
    name_or_path = os.fspath(name_or_path)
    if name_or_path in PRESETS and PRESETS[name_or_path].hub_id:
        return PRESETS[name_or_path].hub_id
    if os.path.isdir(name_or_path):
        return os.path.abspath(name_or_path)
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
