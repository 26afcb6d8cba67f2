"""What FSD's divergence costs a verification step on a CPU: the kl_qp of the expanded tree nodes three ways. "before":
what node_divergences did until the sixteenth session (every node's row, q scattered onto the full target
vocabulary, NaN put at unexpanded nodes afterwards); "full vocabulary": the same formula on the expanded nodes only
(the general path node_divergences keeps for the other divergences); "draft vocabulary": the path it takes for kl_qp
with a reduced draft vocabulary (p's log-normaliser, then the draft vocabulary's columns only). Qwen2.5 sizes: 151,936 target logits, tokenizer
151,665, draft vocabulary 37,888; E expanded nodes of an n-node tree. Median of 200 calls each, arms interleaved.

    PYTHONPATH=. python benchmarks/fsd_divergence_probe.py [threads]
"""
import math
import statistics
import sys
import time

import torch

from eagle_fsd.divergence import align_vocab, divergence
from eagle_fsd.fsd import FsdConfig, node_divergences
from eagle_fsd.tree.dynamic import DraftPool, select_tree

WIDTH, VOCAB, DRAFT_VOCAB = 151936, 151665, 37888


def tree_of(expanded: int, nodes: int):
    """A chain of `expanded` expanded nodes (root first) plus unexpanded leaves, `nodes` in all."""
    gen = torch.Generator().manual_seed(0)
    draft_vocab = torch.randperm(VOCAB, generator=gen)[:DRAFT_VOCAB]
    pool_size = nodes - 1
    parents = torch.tensor([min(i, expanded - 1) for i in range(pool_size)])  # node i's parent: pool index
    depths = torch.tensor([min(i, expanded - 1) + 1 for i in range(pool_size)])
    dist_row = torch.tensor(list(range(expanded)) + [-1] * (pool_size + 1 - expanded))
    pool = DraftPool(draft_vocab[:pool_size].clone(), -torch.arange(pool_size, dtype=torch.float) * 0.01, parents,
                     depths, dist_row, torch.randn(expanded, DRAFT_VOCAB, generator=gen) * 3, draft_vocab)
    return select_tree(torch.tensor(1), pool, nodes, int(depths.max())), torch.randn(nodes, WIDTH, generator=gen) * 3


def before(tree, target_logits):
    draft = tree.draft_logprobs_over(WIDTH)[tree.dist_index.clamp(min=0)]
    target, draft = align_vocab(target_logits.float(), draft, VOCAB)
    return torch.where(tree.dist_index >= 0, divergence(target, draft, "kl_qp"), math.nan)


def full_vocabulary(tree, target_logits):
    expanded = tree.dist_index >= 0
    draft = tree.draft_logprobs_over(WIDTH)[tree.dist_index[expanded]]
    return divergence(*align_vocab(target_logits[expanded], draft, VOCAB), "kl_qp")


def main():
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
    config = FsdConfig(2.0, "kl_qp")
    print(f"threads {torch.get_num_threads()}; ms per call, median of 200")
    for expanded, nodes in ((1, 4), (3, 4), (6, 16)):
        tree, target_logits = tree_of(expanded, nodes)
        arms = {"before": lambda: before(tree, target_logits),
                "full vocabulary": lambda: full_vocabulary(tree, target_logits),
                "draft vocabulary": lambda: node_divergences(tree, target_logits, config, VOCAB)}
        times = {name: [] for name in arms}
        for _ in range(200):
            for name, arm in arms.items():
                start = time.perf_counter()
                arm()
                times[name].append(time.perf_counter() - start)
        got = node_divergences(tree, target_logits, config, VOCAB)[tree.dist_index >= 0]
        gap = (got - full_vocabulary(tree, target_logits)).abs().max().item()
        row = "  ".join(f"{name} {statistics.median(t) * 1e3:.2f}" for name, t in times.items())
        print(f"{expanded} expanded of {nodes} nodes: {row}  (largest difference {gap:.1e})")


if __name__ == "__main__":
    main()
