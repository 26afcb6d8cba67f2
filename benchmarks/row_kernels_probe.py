"""The target's quantized products (eagle_fsd.target_quant: int4 x int8 where weights are 4-bit, int8 x int8 elsewhere,
through int8_rows where a build of it takes this CPU's activation bits, with FBGEMM's beside it, else through FBGEMM) at the row counts
of plain steps, small trees and a prompt: ms a call at 1 / 2 / 4 / 5 / 8 / 64 rows, 2 threads, random weights of
Qwen2.5-1.5B's MLP and v projection shapes, median of 3 rounds. "mem": 14 or 28 copies rotated (past a 32 MB L3),
as in decoding; "L3": one copy. Runs on any CPU with the int4 kernel (AVX-512 VNNI or AVX2).

    python benchmarks/row_kernels_probe.py
"""
import statistics
import time

import torch

from eagle_fsd.kernels.int4_rows import cpu_flags, int4_rows_isa
from eagle_fsd.target_quant import Int4Product, Int8Product, activation_bits

ROWS = (1, 2, 4, 5, 8, 64)  # plain steps, trees, a prompt


def ms_a_call(products, rows: int, in_features: int, rounds: int = 3) -> float:
    x = torch.randn(rows, in_features)
    for product in products[:2]:
        product(x)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for product in products:
            product(x)
        times.append((time.perf_counter() - start) / len(products))
    return statistics.median(times) * 1e3


def main():
    torch.set_num_threads(2)
    print("int4 kernel build:", int4_rows_isa(), "| int8 activation bits:", activation_bits(cpu_flags()))
    for out_features, in_features, copies, where in ((8960, 1536, 14, "mem"), (8960, 1536, 1, "L3"),
                                                     (1536, 8960, 14, "mem"), (256, 1536, 28, "mem")):
        weights = [torch.randn(out_features, in_features) * 0.02 for _ in range(copies)]
        kinds = {"int4": [Int4Product(w, None) for w in weights],
                 "int8": [Int8Product(w, None, activation_bits(cpu_flags())) for w in weights]}
        if kinds["int8"][0].rows_kernel:  # this CPU's int8 layers run int8_rows: FBGEMM beside it
            kinds["int8 FBGEMM"] = [Int8Product(w, None, activation_bits(cpu_flags()), rows_kernel=False)
                                    for w in weights]
        for name, products in kinds.items():
            cells = " / ".join(f"{ms_a_call(products, rows, in_features):.3f}" for rows in ROWS)
            print(f"{name} {out_features}x{in_features} {where}: ms at {' / '.join(map(str, ROWS))} rows  {cells}")


if __name__ == "__main__":
    main()
