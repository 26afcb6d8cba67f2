"""Kernel probe behind eagle_fsd.target_quant: ms of Qwen2.5-1.5B's MLP up-projection (1536 -> 8960) over 1-32 rows,
weights rotating over 1 GB of fp32 copies (so every kind is read from memory, as in decoding, even past a 105 MB L3),
median of 5 rounds, 2 threads. The int4 kernel's other builds (AVX2 on an AVX-512 VNNI CPU) get a column each.

    python benchmarks/target_quant_kernels.py
"""
import math
import time

import torch

from eagle_fsd.prepack import pack_weight, packed_linear, prepack_supported
from eagle_fsd.quant import INT4_GROUP, QuantLinear
from eagle_fsd.kernels.int4_rows import int4_rows_available, int4_rows_isa, int4_rows_linear, runnable_isas, cpu_flags
from eagle_fsd.target_quant import Int4Product, RowQuantLinear

HIDDEN, INTERMEDIATE = 1536, 8960


def kernels(weights):
    """name -> (one layer per weight copy, the product, the activation dtype)."""
    int4 = [QuantLinear.from_weight(w.bfloat16(), None, 4) for w in weights]
    int8 = [QuantLinear.from_weight(w.bfloat16(), None, 8) for w in weights]
    bf16_packed = {"bf16 prepacked": ([pack_weight(w.bfloat16()) for w in weights],
                                      lambda x, w: packed_linear(x, w, None), torch.bfloat16)
                   } if prepack_supported(torch.bfloat16, "cpu") else {}  # oneDNN bf16: AVX-512 BF16 or AMX only
    return bf16_packed | {
        "int4 weight-only": (int4, lambda x, layer: torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, layer.q, INT4_GROUP, layer.scale), torch.bfloat16),  # without QuantLinear's 4-row fallback
        "int8 weight-only": (int8, lambda x, layer: torch.ops.aten._weight_int8pack_mm(x, layer.q, layer.scale),
                             torch.bfloat16),
        "int8 x int8 (RowQuantLinear)": ([RowQuantLinear.from_weight(w, None) for w in weights],
                                        lambda x, layer: layer(x), torch.float32),
    } | ({"int4 x int8 (int4_rows)": ([Int4Product(w, None) for w in weights], lambda x, product: product(x),
                                      torch.float32)} if int4_rows_available() else {}) | {
        f"int4 x int8 ({isa} build)": ([Int4Product(w, None) for w in weights],
                                        lambda x, product, isa=isa: int4_rows_linear(x, product.packed,
                                                                                     product.out_features, isa=isa),
                                        torch.float32)
        for isa in runnable_isas(cpu_flags(), "") if isa != int4_rows_isa()}  # the builds `auto` does not pick here


def main():
    torch.set_num_threads(2)
    torch.set_grad_enabled(False)
    copies = max(1, math.ceil(1024 * 2**20 / (HIDDEN * INTERMEDIATE * 4)))
    weights = [torch.randn(INTERMEDIATE, HIDDEN) * 0.02 for _ in range(copies)]
    table = kernels(weights)
    print("rows  " + "  ".join(f"{name:>28}" for name in table))
    for rows in (1, 2, 4, 5, 8, 16, 32):
        cells = []
        for layers, product, dtype in table.values():
            x = torch.randn(rows, HIDDEN).to(dtype)
            for layer in layers:
                product(x, layer)
            times = []
            for _ in range(5):
                start = time.perf_counter()
                for layer in layers:
                    product(x, layer)
                times.append((time.perf_counter() - start) / len(layers) * 1e3)
            cells.append(sorted(times)[2])
        print(f"{rows:>4}  " + "  ".join(f"{ms:>28.2f}" for ms in cells), flush=True)


if __name__ == "__main__":
    main()
