"""Speculation that pays on this machine: a measured cost model and the draft tree it chooses.

One speculative step emits E[a + 1] tokens (a = accepted draft tokens, +1 for the target's own token) and costs

    t_step(n, d, k, v) = t_verify(n) + d * t_level(k, v) + t_extend(v) + t_overhead

for a tree of n nodes grown by d draft forwards of k nodes each (EAGLE's total_token, depth, top_k), the drafter
scoring a draft vocabulary of the v most frequent tokens (v = 0: the whole vocabulary). Plain decoding emits one
token per t_plain. So the predicted speedup of a shape is

    speedup(n, d, k, v) = E[a + 1 | n, d, k, v] * t_plain / t_step(n, d, k, v)

`measure` times every term on this machine (target forwards over n new tokens, draft forwards over k nodes, the
drafter's catch-up, the engine's own per-step cost and plain decoding, all through the real engine) and measures
E[a + 1 | shape] by replay: the target's greedy continuation of shipped calibration prompts is decoded once, then
at every position the drafter grows its pool as in a real step and the accepted length of every candidate tree is
read off it (for greedy decoding the accepted path is the longest prefix of that continuation the tree holds, so
the replay is exact, and one pool per top_k serves every depth and size). `choose_shape` takes the argmax; when it
is below 1 the engine decodes plainly. Profiles are cached as JSON per model, drafter, device, dtype and threads,
only when the machine was quiet while timing (trust), and checked against the machine at every load (check_costs).

Each acceptance rule gets a tree of its own (follow): an FSD rule accepts more than lossless decoding, by a rescue
rate measured by replay along the same continuations (rule_replay), and every rule's tree is re-chosen while it runs
from the acceptance it measures, with a margin so that noise does not flip it.

Modules: profile (the formula, CostProfile, choose_shape, Tuning), replay (E[a + 1] by exact greedy replay), follow
(the tree of a rule, and following it), rule_replay (a rule's rescue rate), measure
(timing the terms, TuneSettings, the check of a cached profile at load), trust (whether the machine was quiet
enough to cache what was timed), store (the JSON cache, autotune), dtype (dtype, prepack,
draft_quant and target_quant "auto"); `eagle-fsd tune` and the cost-curve plot are an app, eagle_fsd.tune_cli. The other
public names are re-exported here.
"""
from eagle_fsd.tune.dtype import (cpu_class, cpu_flags, fastest_kind, native_bf16, resolve_draft_quant,
                                  resolve_dtype, resolve_prepack, resolve_target_quant, target_quant_choice)
from eagle_fsd.tune.measure import (CALIBRATION_FILE, MAX_DEPTH, SIZES, TOP_KS, DraftSetup, TuneSettings,
                                    calibration_prompts, check_costs, device_name, measure, measure_costs,
                                    measure_overhead, timed_rounds)
from eagle_fsd.tune.profile import CostProfile, Tuning, choose_shape, describe, tuning_from
from eagle_fsd.tune.replay import (accepted_lengths, accepted_path, cut_to_vocab, replay, tau_by_shape, target_hidden,
                                   walk)
from eagle_fsd.tune.store import TUNE_VERSION, autotune, cache_key, cache_path, load_or_measure, read_profile

__all__ = ["CALIBRATION_FILE", "MAX_DEPTH", "SIZES", "TOP_KS", "TUNE_VERSION", "CostProfile", "DraftSetup",
           "TuneSettings", "Tuning", "accepted_lengths", "accepted_path", "autotune",
           "cache_key", "cache_path", "calibration_prompts", "check_costs", "choose_shape", "cpu_flags",
           "cpu_class", "cut_to_vocab", "describe", "device_name", "fastest_kind", "load_or_measure", "measure",
           "measure_costs", "measure_overhead", "native_bf16", "read_profile", "replay",
           "resolve_draft_quant", "resolve_dtype", "resolve_prepack", "resolve_target_quant", "target_hidden",
           "target_quant_choice", "tau_by_shape", "timed_rounds", "tuning_from", "walk"]
