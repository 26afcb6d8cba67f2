"""The bytes a plain decoding step reads from the target's quantized products, by kind: the Qwen preset at its
defaults (its GGUF's Q4_K / Q6_K blocks where that file is cached, else int4 x int8 where it is 4-bit and int8 x int8
elsewhere). Divided by the profile's t_plain, the memory
rate a one-token step runs at; set beside the row kernels' rate from memory (benchmarks/row_kernels_probe.py) it says
whether the step is bound by bandwidth, and which weights to shrink.

    python benchmarks/step_bytes_probe.py

Then the same for one forward of the drafter: its layers and its head over the draft vocabulary.
"""
import torch

from eagle_fsd.model import EaFsdModel
from eagle_fsd.target_quant import Int4Product, RowQuantLinear, own_product


def product_bytes(module, skip: str = "") -> dict:
    """{kind: [bytes, weights]} of the quantized products under `module` (names containing `skip` left out), each
    product once (one shared by several projections, q | k | v, is read once)."""
    kinds, seen = {}, set()
    for name, layer in module.named_modules():
        if not isinstance(layer, RowQuantLinear) or (skip and skip in name):
            continue
        product = own_product(layer.product)
        if id(product) in seen:
            continue
        seen.add(id(product))
        size = sum(t.numel() * t.element_size() for t in product.state().values())
        kind = getattr(product, "kind", "int4" if isinstance(product, Int4Product) else "int8")
        kind += " lm_head" if "lm_head" in name else ""
        counts = kinds.setdefault(kind, [0, 0])
        counts[0] += size
        counts[1] += product.out_features * product.in_features
    return kinds


def report(kinds: dict, what: str) -> None:
    total = sum(size for size, _ in kinds.values())
    for kind, (size, weights) in kinds.items():
        print(f"{kind:13} {weights / 1e6:7.1f} M weights {size / 1e6:7.1f} MB  {size / weights:.3f} B a weight  "
              f"{size / total:6.1%} of the bytes")
    print(f"{what} reads {total / 1e6:.1f} MB of weights")


def main():
    torch.set_num_threads(2)
    model = EaFsdModel.from_pretrained("qwen2.5-coder-1.5b-instruct")
    report(product_bytes(model.base_model), "a plain step")
    drafter = model.drafter  # its layers, and its head over the draft vocabulary in place of the full lm_head
    kinds = product_bytes(drafter.module, skip="lm_head")
    head = drafter.draft_head.quant
    if isinstance(head, RowQuantLinear):
        kinds.update({f"{kind} draft head": counts for kind, counts in product_bytes(head).items()})
    report(kinds, f"a draft forward ({model.plan.drafter.label()}, draft vocabulary {model.shape.draft_vocab})")


if __name__ == "__main__":
    main()
