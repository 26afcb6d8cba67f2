"""The frontier picture of one benchmark: accuracy against speedup over lossless speculative decoding."""
from __future__ import annotations

from pathlib import Path


def plot_frontier(path: Path, rows: list[dict], title: str) -> Path:
    """One line per (divergence, rule, tree) through its thresholds in T order, each point labelled with T. Vertical
    bars: lossless accuracy + the 95 % paired interval of the difference (what the comparison on the same problems
    allows); horizontal bars: the speedup's paired interval. Lossless is the dashed cross at (1, its accuracy);
    plain decoding, where it ran, a square."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    lossless = next((r for r in rows if r["method"] == "lossless"), None)
    base = lossless["accuracy"] if lossless else None
    if lossless:
        ax.axhline(base, color="k", ls="--", lw=0.8, label=f"lossless ({base:.3f})")
        ax.axvline(1.0, color="k", ls=":", lw=0.8)
    curves: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["threshold"] is not None and r["speedup_vs_lossless"] is not None:
            curves.setdefault((r["divergence"], r["mode"], r.get("tree")), []).append(r)
    for i, ((divergence, mode, tree), points) in enumerate(curves.items()):
        points.sort(key=lambda r: r["threshold"])
        xs = [r["speedup_vs_lossless"] for r in points]
        ys = [r["accuracy"] for r in points]
        yerr = [[max(y - max(base + r["diff_low"], 0), 0) for y, r in zip(ys, points)],
                [max(min(base + r["diff_high"], 1) - y, 0) for y, r in zip(ys, points)]] if base is not None else None
        xerr = [[max(x - r["speedup_low"], 0) for x, r in zip(xs, points)],
                [max(r["speedup_high"] - x, 0) for x, r in zip(xs, points)]]
        label = (divergence if mode == "reducible" else f"{divergence} ({mode})") + (f", tree {tree}" if tree else "")
        ax.errorbar(xs, ys, yerr=yerr, xerr=xerr, fmt="o-", color=f"C{i}", capsize=3, label=label)
        for x, y, r in zip(xs, ys, points):
            ax.annotate(f"T={r['threshold']:g}", (x, y), textcoords="offset points", xytext=(4, 4 - 11 * i),
                        fontsize=8, color=f"C{i}")
    for r in rows:  # lossless decoding on another tree than the model's
        if r["threshold"] is None and r.get("tree") and r["speedup_vs_lossless"] is not None:
            ax.plot(r["speedup_vs_lossless"], r["accuracy"], "D", color="k", fillstyle="none",
                    label=f"lossless, tree {r['tree']}")
    plain = next((r for r in rows if r["method"] == "plain" and r["speedup_vs_lossless"]), None)
    if plain:
        ax.plot(plain["speedup_vs_lossless"], plain["accuracy"], "s", color="grey",
                label=f"plain decoding ({plain['problems']} problems)")
    ax.set_xlabel("speedup over lossless speculative decoding (tokens/s ratio, same problems)")
    ax.set_ylabel("accuracy")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
