"""The frontier picture of one benchmark: accuracy against the time per answer over lossless speculative decoding."""
from __future__ import annotations

from pathlib import Path


def series_of(row: dict) -> str:
    """An FSD row's curve: its rule without the threshold (divergence, guards, mode), and its tree where pinned."""
    return row["method"].split(" T=")[0] + (f", tree {row['tree']}" if row.get("tree") else "")


def frontier_points(rows: list[dict]) -> dict[str, list[dict]]:
    """The FSD rows as points by curve (series_of), in threshold order: x the time per answer × lossless (what a user
    waits for; replies that grow count) with its paired interval, y the accuracy with the paired interval of its
    difference from lossless. Rows without a time per answer are left out."""
    curves: dict[str, list[dict]] = {}
    for r in sorted(rows, key=lambda r: r["threshold"] if r["threshold"] is not None else -1.0):
        if r["threshold"] is None or r.get("answer_time_vs_lossless") is None:
            continue
        curves.setdefault(series_of(r), []).append(
            {"T": r["threshold"], "x": r["answer_time_vs_lossless"], "x_low": r["answer_time_low"],
             "x_high": r["answer_time_high"], "y": r["accuracy"], "diff_low": r["diff_low"],
             "diff_high": r["diff_high"]})
    return curves


def plot_frontier(path: Path, rows: list[dict], title: str) -> Path:
    """One line per curve (frontier_points) through its thresholds, each point labelled with T. Vertical bars:
    lossless accuracy + the 95 % paired interval of the difference (what the comparison on the same problems allows);
    horizontal bars: the time per answer's paired interval. Lossless is the dashed cross at (1, its accuracy); plain
    decoding, where it ran, a square."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    lossless = next((r for r in rows if r["method"] == "lossless"), None)
    base = lossless["accuracy"] if lossless else None
    if lossless:
        ax.axhline(base, color="k", ls="--", lw=0.8, label=f"lossless ({base:.3f})")
        ax.axvline(1.0, color="k", ls=":", lw=0.8)
    for i, (label, points) in enumerate(frontier_points(rows).items()):
        xs, ys = [p["x"] for p in points], [p["y"] for p in points]
        yerr = [[max(p["y"] - max(base + p["diff_low"], 0), 0) for p in points],
                [max(min(base + p["diff_high"], 1) - p["y"], 0) for p in points]] if base is not None else None
        xerr = [[max(p["x"] - p["x_low"], 0) for p in points], [max(p["x_high"] - p["x"], 0) for p in points]]
        ax.errorbar(xs, ys, yerr=yerr, xerr=xerr, fmt="o-", color=f"C{i}", capsize=3, label=label)
        for p in points:
            ax.annotate(f"T={p['T']:g}", (p["x"], p["y"]), textcoords="offset points", xytext=(4, 4 - 11 * i),
                        fontsize=8, color=f"C{i}")
    for r in rows:  # lossless decoding on another tree than the model's
        if r["threshold"] is None and r.get("tree") and r.get("answer_time_vs_lossless") is not None:
            ax.plot(r["answer_time_vs_lossless"], r["accuracy"], "D", color="k", fillstyle="none",
                    label=f"lossless, tree {r['tree']}")
    plain = next((r for r in rows if r["method"] == "plain" and r.get("answer_time_vs_lossless")), None)
    if plain:
        ax.plot(plain["answer_time_vs_lossless"], plain["accuracy"], "s", color="grey",
                label=f"plain decoding ({plain['problems']} problems)")
    ax.set_xlabel("time per answer: lossless / this setting (same problems; > 1: replies finish sooner)")
    ax.set_ylabel("accuracy")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
