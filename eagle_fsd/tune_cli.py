"""`eagle-fsd tune`: measure the cost model on this machine, print the predicted speedup of each tree shape, cache
the profile; and the cost-curve plot."""
from __future__ import annotations

import argparse

import torch

from eagle_fsd.dtypes import dtype_name
from eagle_fsd.eval.data import load_questions
from eagle_fsd.loading import drafter_name as preset_drafter_name
from eagle_fsd.model import EaFsdModel
from eagle_fsd.settings import DTYPE_NAMES, add_kernel_args
from eagle_fsd.tune.dtype import forget_races
from eagle_fsd.tune.measure import TuneSettings
from eagle_fsd.tune.profile import CostProfile, choose_shape
from eagle_fsd.tune.store import load_or_measure, read_profile


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="eagle-fsd tune", description="measure the speculation cost model on this "
                                "machine, print the predicted speedup of each tree shape and cache the profile")
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--drafter", default=None, help="LM drafter (preset, dir or hub id); default: the preset's")
    p.add_argument("--ea-model-path", default=None, help="EAGLE-1/2 head (dir or hub id)")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="auto")
    add_kernel_args(p)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--force", action="store_true",
                   help="measure again even if a cached profile exists (the kernel choices too), and cache the "
                        "result even if the machine was busy while tuning (without it a busy machine's profile is "
                        "used once, not cached)")
    p.add_argument("--top", type=int, default=8, help="print the N best shapes")
    p.add_argument("--plot", default=None, help="write the cost curves (t_verify(n) / t_verify(1)) to this PNG")
    p.add_argument("--mtbench", type=int, default=0, metavar="N",
                   help="analysis: measure acceptance on the first turns of the first N MT-Bench questions instead "
                        "of the shipped calibration prompts (what that evaluation set allows; cached apart)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.force:
        forget_races()  # the kernel choices (dtype, prepacking, int4 / int8) are timed again too
    model = EaFsdModel.from_pretrained(args.model, ea_model_path=args.ea_model_path, draft_model=args.drafter,
                                       dtype=args.dtype, total_token=1, depth=1, top_k=1, draft_vocab=0,  # measured below
                                       prepack=args.prepack, draft_quant=args.draft_quant,
                                       target_quant=args.target_quant)
    if model.drafter is None:
        raise ValueError(f"{args.model!r} has no default drafter: pass --drafter or --ea-model-path")
    settings = None
    if args.mtbench:
        texts = tuple(q["turns"][0] for q in load_questions()[: args.mtbench])
        settings = TuneSettings(prompts=len(texts), prompt_texts=texts)
    drafter_name = preset_drafter_name(args.model, args.ea_model_path, args.drafter)  # as from_pretrained names it
    profile, path = load_or_measure(model, args.model, drafter_name, force=args.force, settings=settings)
    cached = read_profile(path)
    written = cached is not None and cached.conditions.get("measured_at") == profile.conditions.get("measured_at")
    print(f"cost profile: {path}" + ("" if written else " (not written: timed on a busy machine)"))
    print(f"run plan: {model.plan.summary()} (--target-quant, --prepack, --draft-quant)")
    print(format_profile(profile, args.top))
    if args.plot:
        plot_cost_curves({f"{args.model} ({dtype_name(model.base_model.dtype)})": profile}, args.plot)
        print(f"wrote {args.plot}")
    return 0


def plot_cost_curves(profiles: dict[str, CostProfile], path: str) -> None:
    """t_verify(n) / t_verify(1) per profile, and the best predicted speedup for each tree size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cost, gain) = plt.subplots(1, 2, figsize=(10, 4))
    for label, profile in profiles.items():
        sizes = sorted(profile.verify_ms)
        base = profile.verify_ms[sizes[0]]
        cost.plot(sizes, [profile.verify_ms[n] / base for n in sizes], marker="o", label=label)
        best = [max((profile.speedup(s) for s in profile.tau if s[0] == n), default=float("nan")) for n in sizes]
        gain.plot(sizes, best, marker="o", label=label)
    cost.plot([1, max(max(p.verify_ms) for p in profiles.values())], [1, max(max(p.verify_ms) for p in profiles.values())],
              ls=":", color="grey", label="linear in n")
    cost.set(xlabel="tree tokens verified (n)", ylabel="t_verify(n) / t_verify(1)", xscale="log", yscale="log",
             title="verification cost, measured")
    gain.axhline(1.0, ls=":", color="grey")
    gain.set(xlabel="tree tokens verified (n)", ylabel="predicted speedup over plain", xscale="log",
             title="best shape of each size, predicted")
    for ax in (cost, gain):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_profile(profile: CostProfile, top: int = 8) -> str:
    base = profile.verify_ms[min(profile.verify_ms)]
    lines = ["t_verify(n) / t_verify(1): " + "  ".join(f"{n}:{v / base:.2f}" for n, v in sorted(profile.verify_ms.items())),
             f"t_plain {profile.plain_ms:.1f} ms/token, t_verify(1) {base:.1f} ms; draft level (k, vocab) "
             + ", ".join(f"({k}, {v or 'full'}): {t:.1f}" for (k, v), t in sorted(profile.level_ms.items()))
             + " ms; catch-up " + ", ".join(f"{v or 'full'}: {t:.1f}" for v, t in sorted(profile.extend_ms.items()))
             + f" ms; engine overhead {profile.overhead_ms:.1f} ms/step; prefill per prompt token {profile.prefill_ms:.2f} ms"
             + f" (drafter {profile.draft_prefill_ms:.2f} ms)",
             f"{'total_token':>11} {'depth':>5} {'top_k':>5} {'vocab':>6} {'tau':>6} {'step ms':>8} {'speedup':>8}"]
    ranked = sorted(profile.tau, key=profile.speedup, reverse=True)[:top]
    for s in ranked:
        lines.append(f"{s[0]:>11} {s[1]:>5} {s[2]:>5} {s[3] or 'full':>6} {profile.tau[s]:>6.2f} "
                     f"{profile.step_ms(s):>8.1f} {profile.speedup(s):>7.2f}x")
    best, speedup = choose_shape(profile)
    verdict = f"speculate with {best}" if speedup > 1 else "decode plainly (no shape beats plain decoding)"
    lines.append(f"choice: {verdict}, predicted {speedup:.2f}x")
    return "\n".join(lines)
