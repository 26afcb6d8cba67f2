"""What the timed outputs of `eagle-fsd bench` come to: each method's totals (tokens, seconds, the engine's counts,
identity with HF generate's, plain's and the peers' own plain outputs, vLLM's rows folded in), the summary rows
(tokens/s, speedups, tau, identity) and the printed table."""
from __future__ import annotations

from collections import defaultdict

import torch

from eagle_fsd.dtypes import dtype_name
from eagle_fsd.presets import drafter_label
from eagle_fsd.settings import Settings
from eagle_fsd.tune import device_name
from eagle_fsd.eval.arms import parse_tree
from eagle_fsd.tune.follow import fit_rescue_on_trees, rule_prediction, shape_key, trees_run_speedup
from eagle_fsd.tune.profile import workload_speedup

PHASES = ("draft_prefill", "draft", "verify", "accept", "cache", "other")


def lossy(name: str) -> bool:
    return name.startswith(("fsd", "vllm fsd"))


def peer(name: str) -> bool:
    """Rows of other engines: their speculation is compared with their own plain row, not with ours."""
    return name.startswith(("vllm", "llama.cpp"))


def shared_prefix(sequence: torch.Tensor, reference: torch.Tensor, prompt_len: int) -> int:
    """How many new tokens two outputs share before they first differ."""
    a, b = sequence[0, prompt_len:], reference[0, prompt_len:]
    n = min(a.numel(), b.numel())
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0, 0]) if differ.numel() else n


def sequences_and_time(out) -> tuple[torch.Tensor, float]:
    """(output sequences, seconds) of one run: a dict (HF generate, the peers) or the engine's output."""
    if isinstance(out, dict):
        return out["sequences"], out["wall_time"]
    return out.sequences, out.wall_time


def add_engine_counts(t: dict, out) -> None:
    """Into one method's totals: an engine run's counts (verification steps, accepted and fuzzy tokens, plain steps,
    tree switches, steps per tree, seconds per phase), or a peer's target forwards."""
    if not isinstance(out, dict):
        t["steps"] += out.verify_steps
        t["accepted"] += sum(out.accept_lengths)
        t["fuzzy"] += sum(out.fuzzy_accepts)
        t["plain_steps"] += out.plain_steps
        t["tree_switches"] += out.tree_switches
        for tree, steps in out.tree_steps.items():
            t[f"tree {tree}"] += steps
        for phase, sec in out.phase_seconds.items():
            t[f"phase_{phase}"] += sec
    elif "target_forwards" in out:  # a peer's speculative row
        t["steps"] += out["target_forwards"]


def add_identity(t: dict, name: str, seq: torch.Tensor, prompt_len: int, qi: int,
                 references: dict[str, list]) -> None:
    """Into a lossless row's totals: whether its output on question qi equals HF generate's, plain's, or (a llama.cpp
    draft row's) plain llama.cpp's, and how many new tokens it shares with them; the reference rows' outputs go into
    `references` ("hf-generate", "plain", "llama.cpp": outputs by question), which the rows after them read."""
    if name == "hf-generate":
        references["hf-generate"].append(seq)
    elif not lossy(name):
        hf_output = references["hf-generate"][qi]
        t["identical"] += int(torch.equal(seq, hf_output))
        t["shared_with_hf"] += shared_prefix(seq, hf_output, prompt_len)
        if name == "plain":
            references["plain"].append(seq)
        elif name.startswith("llama.cpp "):  # its draft row against its own plain row
            t["identical_to_llama_cpp"] += int(torch.equal(seq, references["llama.cpp"][qi]))
        elif name == "llama.cpp":
            references["llama.cpp"].append(seq)
        elif references["plain"]:
            t["identical_to_plain"] += int(torch.equal(seq, references["plain"][qi]))
            t["shared_with_plain"] += shared_prefix(seq, references["plain"][qi], prompt_len)


def add_vllm_rows(rows: dict, ids_list, reference, totals, per_question) -> None:
    """vLLM's rows into the totals, compared with HF generate's outputs as the engine's rows are, and with plain
    vLLM's (its speculation is lossless up to its kernels' rounding)."""
    for name, runs in rows.items():
        t = totals[name] = defaultdict(float)
        per_question[name] = []
        for qi, (ids, ref, r) in enumerate(zip(ids_list, reference, runs)):
            t["tokens"] += len(r["tokens"])
            t["seconds"] += r["wall_time"]
            if name != "vllm":  # target forwards: the prefill, then one per verification step
                t["steps"] += r["steps"] + 1
                t["accepted"] += r["accepted"]
            per_question[name].append(len(r["tokens"]) / r["wall_time"])
            seq = torch.cat([ids, torch.tensor([r["tokens"]], dtype=ids.dtype)], dim=1)
            t["identical"] += int(torch.equal(seq, ref))
            t["shared_with_hf"] += shared_prefix(seq, ref, ids.shape[1])
            if name != "vllm" and "vllm" in rows:
                t["identical_to_vllm"] += int(r["tokens"] == rows["vllm"][qi]["tokens"])


def summarize_rows(totals, per_question, questions: int) -> list[dict]:
    """One row per method: tokens/s and speedup over HF generate (in total and per question), tau, identity."""
    base = totals["hf-generate"]["tokens"] / totals["hf-generate"]["seconds"]
    rows = []
    for name, t in totals.items():
        tps = t["tokens"] / t["seconds"]
        ratios = [a / b for a, b in zip(per_question[name], per_question["hf-generate"])]
        row = {"method": name, "tokens": int(t["tokens"]), "seconds": round(t["seconds"], 2),
               "tokens_per_s": round(tps, 3), "speedup": round(tps / base, 3),
               "speedup_min_question": round(min(ratios), 3), "speedup_per_question": [round(r, 3) for r in ratios]}
        if t["steps"]:
            row["tau"] = round(t["tokens"] / t["steps"], 3)
        if "fuzzy" in t:  # the engine's own rows
            row["fuzzy_fraction"] = round(t["fuzzy"] / max(t["accepted"], 1), 3)
            row["trees"] = {k.removeprefix("tree "): int(v) for k, v in t.items() if k.startswith("tree ")}
            row["tree_switches"] = int(t["tree_switches"])
            row["plain_steps"] = int(t["plain_steps"])  # the speed guard's steps without a draft
            row.update(step_costs(t, questions))
        if name.startswith("fsd") and "eagle-fsd" in totals:  # per answer: what a user waits for, longer replies too
            lossless = totals["eagle-fsd"]
            row["answer_time_vs_lossless"] = round(lossless["seconds"] / t["seconds"], 3)
            row["length_vs_lossless"] = round(t["tokens"] / lossless["tokens"], 3)
        if name != "hf-generate" and not lossy(name):
            row["identical_to_hf_generate"] = f"{int(t['identical'])}/{questions}"
            # new tokens equal to the reference's before the first difference, averaged over the questions
            row["shared_prefix_with_hf_generate"] = round(t["shared_with_hf"] / questions, 1)
            if name != "plain" and "plain" in totals and not peer(name):
                row["identical_to_plain"] = f"{int(t['identical_to_plain'])}/{questions}"
                row["shared_prefix_with_plain"] = round(t["shared_with_plain"] / questions, 1)
            if name.startswith("vllm ") and "vllm" in totals:
                row["identical_to_vllm_plain"] = f"{int(t['identical_to_vllm'])}/{questions}"
            if name.startswith("llama.cpp ") and "llama.cpp" in totals:
                row["identical_to_llama_cpp_plain"] = f"{int(t['identical_to_llama_cpp'])}/{questions}"
        rows.append(row)
    return rows


def step_costs(t: dict, answers: int) -> dict:
    """An engine row's time after the prefills (the cost model's terms): seconds per phase, ms per new token (the
    first token of each answer comes from its prefill), new tokens per step (E[a + 1]) and ms per step,
    verification and the rest apart."""
    phases = {p: t[f"phase_{p}"] for p in PHASES if f"phase_{p}" in t}
    steps_seconds = sum(phases.values()) - phases.get("draft_prefill", 0.0)
    steps = max(t["steps"], 1)
    return {"phase_seconds": {p: round(s, 2) for p, s in phases.items()},
            "ms_per_token_after_prefill": round(1000 * steps_seconds / max(t["tokens"] - answers, 1), 3),
            "tokens_per_step": round((t["tokens"] - answers) / steps, 3),
            "step_ms": {"verify": round(1000 * phases.get("verify", 0.0) / steps, 2),
                        "drafting": round(1000 * (steps_seconds - phases.get("verify", 0.0)) / steps, 2)}}


def summarize(model, settings: Settings, ids_list, totals, per_question, profile=None, shape=None) -> dict:
    """The run's result: its rows and, tuned, the cost model's prediction for the whole workload: with `profile`
    (the tuned profile at the run's mean context) on `shape` (the lossless rule's first tree there, a TreeShape), else
    the tuned choice as loaded."""
    rows = summarize_rows(totals, per_question, len(ids_list))
    m = settings.model
    result = {"model": m.model, "drafter": m.ea_model_path or m.drafter or drafter_label(m.model),
              "dtype": dtype_name(model.base_model.dtype), "questions": len(ids_list),
              "max_new_tokens": settings.generation.max_new_tokens, "tree": [model.total_token, model.depth, model.top_k],
              "threads": torch.get_num_threads(), "device": device_name(model.base_model.device),
              "draft_weights": "none" if model.plan.drafter is None else model.plan.drafter.label(),
              "target_weights": model.plan.target.label(),
              "draft_vocab": model.shape.draft_vocab or "full", "rows": rows}
    if model.tuning is not None:
        by_name = {r["method"]: r for r in rows}
        # the cost model's prediction for this workload: every prompt prefilled, then the new tokens (profile.py)
        prompt_tokens = sum(int(ids.numel()) for ids in ids_list)
        new_tokens = totals["eagle-fsd"]["tokens"] if "eagle-fsd" in totals else 0
        if profile is None or shape is None:
            per_token, whole = model.tuning.predicted_speedup, model.tuning.workload_speedup(prompt_tokens, new_tokens)
        else:
            predicted = rule_prediction(profile, shape, 0.0)
            per_token = predicted["speedup_per_token"]
            whole = workload_speedup(profile.prefill_ms, profile.draft_prefill_ms, profile.plain_ms,
                                     predicted["step_ms"] / predicted["tau"], prompt_tokens, new_tokens)
        result["predicted_speedup_over_plain_per_token"] = round(per_token, 3)
        result["predicted_speedup_over_plain"] = round(whole, 3)
        result["prompt_tokens"] = prompt_tokens
        result["speculate"] = model.tuning.speculate
        if "plain" in by_name:
            measured = by_name["eagle-fsd"]["tokens_per_s"] / by_name["plain"]["tokens_per_s"]
            result["measured_speedup_over_plain"] = round(measured, 3)
    return result


def same_as_plain(row: dict) -> str:
    """Identity with the plain row of the row's own engine."""
    for key in ("identical_to_plain", "identical_to_vllm_plain", "identical_to_llama_cpp_plain"):
        if key in row:
            return row[key]
    return "-"


def print_table(result: dict) -> None:
    print(f"\n{result['model']} + {result['drafter']}, {result['dtype']}, {result['questions']} MT-Bench first turns, "
          f"{result['max_new_tokens']} new tokens, {result['threads']} threads, tree (total_token, depth, top_k) = "
          f"{tuple(result['tree'])}, draft vocabulary {result.get('draft_vocab', 'full')}, target weights "
          f"{result['target_weights']}, drafter weights {result['draft_weights']}, {result['device']}")
    print(f"{'method':<22}{'tok/s':>8}{'vs HF':>8}{'min q':>7}{'tau':>7}{'fuzzy':>7}{'same as HF':>12}"
          f"{'same as plain':>15}")
    for r in result["rows"]:
        tau = f"{r['tau']:.2f}" if "tau" in r else "-"
        fuzzy = f"{r['fuzzy_fraction']:.2f}" if "fuzzy_fraction" in r else "-"
        print(f"{r['method']:<22}{r['tokens_per_s']:>8.2f}{r['speedup']:>7.2f}x{r['speedup_min_question']:>6.2f}x"
              f"{tau:>7}{fuzzy:>7}{r.get('identical_to_hf_generate', '-'):>12}"
              f"{same_as_plain(r):>15}")
    if "predicted_speedup_over_plain" in result:
        print(f"cost model: predicted {result['predicted_speedup_over_plain']:.2f}x over plain for these prompts and "
              f"tokens ({result['predicted_speedup_over_plain_per_token']:.2f}x per new token, prefill aside), "
              f"measured {result.get('measured_speedup_over_plain', float('nan')):.2f}x")
    for r in result["rows"]:
        if "answer_time_vs_lossless" in r:
            print(f"{r['method']} per answer: {r['answer_time_vs_lossless']:.2f}x lossless time to the finished "
                  f"replies, replies {r['length_vs_lossless']:.2f}x as long")
    for r in result["rows"]:
        if r.get("trees"):
            print(f"{r['method']} trees (steps): {r['trees']}, {r['tree_switches']} switches")
    print_rule_predictions(result)
    for r in result["rows"]:
        if r.get("phase_seconds"):
            print(f"{r['method']} time by phase (s): {r['phase_seconds']}")
    if "vllm_version" in result:
        print(f"vllm rows: vLLM {result['vllm_version']} in its own environment, dtype {result['vllm_dtype']}, run "
              "before the others; their 'same as plain' is against plain vLLM")
    if any(r["method"].startswith("llama.cpp") for r in result["rows"]):
        print("llama.cpp rows: llama-cpp-python in this process, greedy, interleaved with the others; their 'same as "
              "plain' is against plain llama.cpp")
    if "peak_rss_gb_engine_loaded" in result:
        print(f"peak RSS with the engine's models loaded: {result['peak_rss_gb_engine_loaded']} GB")


def print_rule_predictions(result: dict) -> None:
    """The cost model's lines per rule: predicted against measured, term by term (add_predictions)."""
    if "prediction_context_tokens" in result:
        print(f"cost model: costs at {result['prediction_context_tokens']:.0f} cached tokens (mean prompt + half the "
              "new tokens)")
    for r in result["rows"]:
        if "prediction" in r and "measured_over_plain_per_token" in r:
            p, step = r["prediction"], r["step_ms"]
            print(f"cost model, {r['method']}: first tree {p['first_tree']} at rescue rate {p['rescue']:.2f}; per new "
                  f"token after the prefill predicted {p['speedup_per_token']:.2f}x plain, measured "
                  f"{r['measured_over_plain_per_token']:.2f}x ({100 * r['prediction_error']:+.0f} %): tau "
                  f"{p['tau']:.2f} / {r['tokens_per_step']:.2f}, step {p['step_ms']:.1f} / "
                  f"{step['verify'] + step['drafting']:.1f} ms (verify {p['verify_ms']:.1f} / {step['verify']:.1f}, "
                  f"drafting and loop {p['drafting_ms']:.1f} / {step['drafting']:.1f}), t_plain {p['plain_ms']:.1f} / "
                  f"{r['plain_ms_per_token']:.1f} ms (predicted / measured)"
                  + (f"; on the trees it ran predicted {r['prediction_on_trees_run']:.2f}x "
                     f"({100 * r['prediction_error_on_trees_run']:+.0f} %), and at the acceptance it measured (rescue "
                     f"rate {r['rescue_measured']:.2f}) {r['prediction_at_measured_acceptance']:.2f}x "
                     f"({100 * r['prediction_error_at_measured_acceptance']:+.0f} %: the costs alone)"
                     if "prediction_on_trees_run" in r else ""))


def add_predictions(result: dict, predictions: dict[str, dict], profile=None) -> None:
    """Each rule's row gets the cost model's prediction over plain decoding beside what it measured over the plain
    row: tokens/s over the whole answers, and like for like with the prediction, per new token after the prefills
    (prediction_error: predicted / measured - 1), with the measured terms (t_plain). With the profile, also the
    prediction for the trees the row ran, each for its steps, at the same replayed rescue rate (a follower that left
    its first tree ran others), and on those trees at the rescue rate that gives the tokens per step it measured
    (acceptance taken as measured: the costs' own miss)."""
    by_name = {r["method"]: r for r in result["rows"]}
    plain = by_name.get("plain")
    for name, predicted in predictions.items():
        row = by_name.get(name)
        if row is None:
            continue
        row["prediction"] = predicted
        if plain is None:
            continue
        row["measured_over_plain"] = round(row["tokens_per_s"] / plain["tokens_per_s"], 3)
        if "ms_per_token_after_prefill" in row and "ms_per_token_after_prefill" in plain:
            measured = plain["ms_per_token_after_prefill"] / row["ms_per_token_after_prefill"]
            row["measured_over_plain_per_token"] = round(measured, 3)
            row["prediction_error"] = round(predicted["speedup_per_token"] / measured - 1, 3)
            row["plain_ms_per_token"] = plain["ms_per_token_after_prefill"]
            steps = {shape_key(parse_tree(label)): count for label, count in row.get("trees", {}).items()}
            plain_steps = row.get("plain_steps", 0)
            on_trees = None if profile is None else trees_run_speedup(profile, steps, predicted["rescue"], plain_steps)
            if on_trees is not None:
                row["prediction_on_trees_run"] = round(on_trees, 3)
                row["prediction_error_on_trees_run"] = round(on_trees / measured - 1, 3)
                # the same trees at the acceptance the row measured on them: what is left is the costs' miss
                drafted = sum(steps.values())
                per_drafted_step = (row["tokens_per_step"] * (drafted + plain_steps) - plain_steps) / drafted
                seen = fit_rescue_on_trees(profile, steps, per_drafted_step)
                costs_only = trees_run_speedup(profile, steps, seen, plain_steps)
                row["rescue_measured"] = round(seen, 3)
                row["prediction_at_measured_acceptance"] = round(costs_only, 3)
                row["prediction_error_at_measured_acceptance"] = round(costs_only / measured - 1, 3)
