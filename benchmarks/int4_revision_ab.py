"""The int4 kernel (kernels/int4_rows.cpp) as this tree has it against its source at another git revision: the same
bits on fresh random inputs, then ms a call at 1 / 2 / 3 / 5 / 8 rows on the Qwen preset's target and drafter shapes,
2 threads, with the weights in cache ("L3": one copy) and from memory ("mem": copies past a 32 MB L3).

Each repetition calls both builds in random order; the figure is the minimum over repetitions (this VM's speed
swings 10-40 % within minutes; the fastest pass is the one least disturbed), the ratio that of the two minima.

    python benchmarks/int4_revision_ab.py [--against 893fd33] [--isa avx2|avx512_vnni] [--reps 15]
"""
import argparse
import random
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from eagle_fsd.kernels import int4_rows as k4
from eagle_fsd.kernels.cpp_build import load_extension

ROWS = (1, 2, 3, 5, 8)
SHAPES = ((8960, 1536, 32), (1536, 8960, 32), (4864, 896, 128))  # target MLP (groups of 32); drafter's (of 128)


def build_at(revision: str, isa: str):
    """The kernel's extension built from its source at git `revision`."""
    root = Path(__file__).resolve().parents[1]
    source = subprocess.run(["git", "show", f"{revision}:kernels/int4_rows.cpp"], cwd=root, check=True,
                            capture_output=True, text=True).stdout
    folder = Path(tempfile.mkdtemp(prefix="int4_rows_"))
    path = folder / f"int4_rows_{revision}.cpp"
    path.write_text(source)
    return load_extension(f"int4_rows_at_{revision}_{isa}", path, ["-O3", "-fopenmp", *k4.ISA_FLAGS[isa][1]],
                          ["-fopenmp"])


def check_same_bits(builds: dict) -> None:
    g = torch.Generator().manual_seed(0)
    empty = torch.empty(0)
    for group in (32, 128):
        packed = k4.pack_int4(*k4.quantize_int4(torch.randn(512, 1536, generator=g) * 0.02, group))
        for rows in (1, 2, 3, 5, 8, 17, 33):
            x = torch.randn(rows, 1536, generator=g)
            ys = [b.int4_rows_linear(x, packed, empty) for b in builds.values()]
            assert torch.equal(ys[0], ys[1]), f"the two revisions' bits differ: group {group}, {rows} rows"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default="893fd33")
    parser.add_argument("--isa", default=k4.int4_rows_isa())
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(2)
    builds = {"this tree": k4._extension(args.isa), args.against: build_at(args.against, args.isa)}
    check_same_bits(builds)
    print(f"build {args.isa}: the same bits on 2 groups x 7 row counts; ms a call (minimum of {args.reps})")
    empty = torch.empty(0)
    for where in ("L3", "mem"):
        for n, k, group in SHAPES:
            copies = 1 if where == "L3" else max(2, int(80e6 // (n * k * 0.6)))
            weights = [k4.pack_int4(*k4.quantize_int4(torch.randn(n, k) * 0.02, group)) for _ in range(copies)]
            calls = max(copies, 40)
            best = {name: {r: float("inf") for r in ROWS} for name in builds}
            for _ in range(args.reps):
                for rows in ROWS:
                    x = torch.randn(rows, k)
                    for name in random.sample(list(builds), len(builds)):
                        start = time.perf_counter()
                        for c in range(calls):
                            builds[name].int4_rows_linear(x, weights[c % copies], empty)
                        best[name][rows] = min(best[name][rows], (time.perf_counter() - start) / calls)
            for name in builds:
                cells = " / ".join(f"{best[name][r] * 1e3:.3f}" for r in ROWS)
                ratio = " / ".join(f"{best[name][r] / best[args.against][r]:.2f}" for r in ROWS)
                print(f"{where} {n} x {k}, groups of {group}, {name}: {cells} ms at {ROWS} rows (x {ratio})")


if __name__ == "__main__":
    main()
