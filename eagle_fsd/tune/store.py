"""Profiles cached as JSON per model, drafter, device, dtype, kernels and threads, and the tuning they give
(autotune: the loader builds the model with its shape)."""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch

from eagle_fsd.dtypes import dtype_name
from eagle_fsd.files import cache_dir
from eagle_fsd.fused_decoder import FUSED_VERSION
from eagle_fsd.tune.measure import TuneSettings, check_costs, device_name, measure
from eagle_fsd.tune.profile import CostProfile, Tuning, describe, tuning_from
from eagle_fsd.tune.trust import CPU_CAP_VARS, describe_age

TUNE_VERSION = 13  # 13: t_verify(n) fitted non-decreasing in n;
#                   12: drafting costs read against t_verify(1) timed again in the drafter's own pass;
#                   11: twelve calibration prompts of more kinds, E[a + 1] pooled over their steps; the target
#                       forwards of both contexts timed in one round-robin;
#                   10: attention by key/value head, draft log-probs in one C++ pass (a step's costs moved);
#                   9: the tree replay reads every calibration prompt (fewer positions each, not fewer prompts);
#                   8: costs timed at two contexts (their slopes per cached token);
#                   7: every calibration prompt's continuation kept for the rules' replay (was the replayed ones);
#                   6: costs timed on a context of TuneSettings.timing_context tokens


def cache_key(model, base_model, drafter_name, settings: TuneSettings | None = None) -> dict:
    """What names a cost profile: the model and drafter, the machine's device and threads, torch, and the model's run
    plan (dtype, weight formats, fused decoders: eagle_fsd.plan.RunPlan.key), which change every timing."""
    target = model.base_model
    drafter_id = drafter_name if isinstance(drafter_name, str) else type(model.drafter).__name__
    key = {"model": str(base_model), "drafter": str(drafter_id), "device": device_name(target.device),
           "dtype": dtype_name(target.dtype), "threads": torch.get_num_threads(),
           "torch": torch.__version__.split("+")[0], "tune_version": TUNE_VERSION, "plan": model.plan.key()}
    if model.plan.target.fused or (model.plan.drafter is not None and model.plan.drafter.fused):
        key["fused_version"] = FUSED_VERSION  # the fused decoder forward (eagle_fsd.fused_decoder) times apart
    capped = {name: os.environ[name] for name in CPU_CAP_VARS if name in os.environ}
    if capped:  # an instruction-set cap changes every timing (e.g. emulating an AVX2-only CPU)
        key["cpu_caps"] = capped
    if settings is not None and settings != TuneSettings():
        key["settings"] = hashlib.sha256(repr(settings).encode()).hexdigest()[:12]
    return key


def cache_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    name = Path(key["model"]).name.replace("/", "_")
    return cache_dir() / "tune" / f"{name}-{digest}.json"


def read_profile(path: Path) -> CostProfile | None:
    """The cached profile at `path`, or None (missing, unreadable or an older format: measure again)."""
    if not path.is_file():
        return None
    try:
        profile = CostProfile.from_json(json.loads(path.read_text())["profile"])
    except (ValueError, KeyError, TypeError):
        return None
    profile.conditions.setdefault("measured_at", path.stat().st_mtime)  # older files: the file's own time
    return profile


def write_profile(path: Path, key: dict, profile: CostProfile, plan: dict | None = None) -> None:
    """The profile, under its key, with the run plan it was measured for (eagle_fsd.plan.RunPlan.to_json)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"key": key, "plan": plan, "profile": profile.to_json()}, indent=1))
    tmp.replace(path)


def load_or_measure(model, base_model, drafter_name, progress: bool = True, settings: TuneSettings | None = None,
                    force: bool = False, check: bool = False) -> tuple[CostProfile, Path]:
    """The cost profile of `model` on this machine: cached, else measured and cached. A profile timed on a busy
    machine (eagle_fsd.tune.trust) is used but not cached, saying why; `force` measures again and caches whatever
    it gets. `check`: a cached profile is first checked against a few timed steps (check_costs) and re-timed where
    it no longer holds (the correction is cached when the machine is quiet)."""
    key = cache_key(model, base_model, drafter_name, settings)
    path = cache_path(key)
    cached = None if force else read_profile(path)
    if cached is not None:
        profile, found = check_costs(model, cached, settings=settings) if check else (cached, "")
        if progress:
            print(f"eagle-fsd: cost profile {path}, measured {age(cached)} ago" + (f"; {found}" if found else ""),
                  file=sys.stderr)
        if profile is not cached and profile.conditions.get("busy") is None:
            write_profile(path, key, profile, model.plan.to_json())
        return profile, path
    if progress:
        print(f"eagle-fsd: measuring speculation costs on this machine ({key['device']}, {key['dtype']}, "
              f"{key['threads']} threads); cached in {path}", file=sys.stderr)
    profile = measure(model, settings, progress=progress)
    busy = profile.conditions.get("busy")
    if busy is not None and not force:
        print(f"eagle-fsd: the machine was busy while tuning ({busy}), so this profile is used for this run only "
              f"and not cached. Tune again on a quieter machine (`eagle-fsd tune --force` caches whatever it "
              "measures).", file=sys.stderr)
        return profile, path
    if busy is not None:
        print(f"eagle-fsd: caching a profile timed on a busy machine ({busy}), as --force asks", file=sys.stderr)
    write_profile(path, key, profile, model.plan.to_json())
    return profile, path


def age(profile: CostProfile) -> str:
    """How long ago the profile's timings were taken."""
    return describe_age(time.time() - profile.conditions.get("measured_at", time.time()))


def autotune(model, base_model, drafter_name, fixed: dict, progress: bool = True,
             settings: TuneSettings | None = None, check: bool = True) -> Tuning:
    """The tuning for `model` (an EaFsdModel with a drafter) from the (cached, checked) cost profile: the fastest
    shape among those with the `fixed` values (TreeShape fields: total_token, depth, branching). `model` is only
    measured; the tuning's shape (Tuning.tree) is for the model the loader builds with it."""
    profile, path = load_or_measure(model, base_model, drafter_name, progress=progress, settings=settings,
                                    check=check)
    tuning = tuning_from(profile, fixed, str(path))
    if progress:
        print(f"eagle-fsd: {describe(tuning)}", file=sys.stderr)
    return tuning
