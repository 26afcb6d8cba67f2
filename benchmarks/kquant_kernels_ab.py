"""kquant_rows (a GGUF's Q4_K / Q6_K blocks) against int4_rows and int8_rows on the Qwen2.5-1.5B shapes the target
runs them on, 2 threads, weights from memory, random valid blocks (int4 / int8 rounded from their values).

Per shape: copies of both packed weights allocated interleaved (so both sample the same physical memory; > 80 MB
each, L3 is 32 MB; the lm_head: 2 copies each), every call on the next copy; the two kernels called in random order
for `REPS` repetitions; reported: median ms of each and the median of per-repetition ratios kquant / baseline.

    python benchmarks/kquant_kernels_ab.py [avx512_vnni|avx2]   (default: the build this CPU runs)
"""
import random
import statistics
import sys
import time

import torch

from eagle_fsd.kernels import int4_rows as k4
from eagle_fsd.kernels import int8_rows as k8
from eagle_fsd.kernels import kquant_rows as kq

torch.set_num_threads(2)
ISA = sys.argv[1] if len(sys.argv) > 1 else k4.int4_rows_isa()
BITS = 8 if ISA == "avx512_vnni" else 7  # int8_rows' build for this ISA takes 8- or 7-bit activations
empty = torch.empty(0)
ext4, ext8, extq = k4._extension(ISA), k8._extension(k8.BUILDS[BITS]), kq._extension(ISA)


def run(kind, n, k, g):
    raw = kq.random_blocks(kind, n, k, g)
    w = kq.dequantize(kind, raw).float()
    packed = kq.pack(kind, raw)
    if kind == "q4_k":
        base = k4.pack_int4(*k4.quantize_int4(w))
        clone, nbytes = base.clone, base.numel()
        call_base = lambda x, c: ext4.int4_rows_linear(x, c, empty)
        name = "int4_rows"
    else:
        base = k8.pack_int8_rows(*k8.quantize_int8(w))
        clone, nbytes = (lambda: tuple(t.clone() for t in base)), base[0].numel()
        call_base = lambda x, c: ext8.int8_rows_linear(x, *c, empty)
        name = f"int8_rows ({BITS}-bit)"
    del w
    count = 2 if n > 100_000 else max(8, -(-80_000_000 // packed.numel()))
    mine, theirs = [], []
    for _ in range(count):
        mine.append(packed.clone())
        theirs.append(clone())
    kid = 4 if kind == "q4_k" else 6
    reps = 40 if n > 100_000 else 400
    print(f"{kind} {n}x{k}: kquant {packed.numel() / 1e6:.2f} MB vs {name} {nbytes / 1e6:.2f} MB, {count} copies each")
    for rows in (1, 3, 5, 8):
        x = torch.randn(rows, k, generator=g)
        fns = [lambda c: extq.kquant_rows_linear(x, c, kid, empty), lambda c: call_base(x, c)]
        times, rng = [[], []], random.Random(rows)
        for r in range(reps + 5):
            for j in rng.sample([0, 1], 2):
                copies = (mine, theirs)[j]
                t0 = time.perf_counter_ns()
                fns[j](copies[r % count])
                times[j].append(time.perf_counter_ns() - t0)
        ta, tb = (t[5:] for t in times)
        ratio = statistics.median(a / b for a, b in zip(ta, tb))
        print(f"  rows {rows}: kquant {statistics.median(ta) / 1e6:.3f} ms, {name} {statistics.median(tb) / 1e6:.3f} "
              f"ms, ratio {ratio:.2f}", flush=True)


g = torch.Generator().manual_seed(0)
print(f"isa {ISA}, {torch.get_num_threads()} threads")
for kind, n, k in (("q4_k", 8960, 1536), ("q4_k", 1536, 8960), ("q6_k", 1536, 8960), ("q6_k", 256, 1536),
                   ("q6_k", 151936, 1536)):
    run(kind, n, k, g)
