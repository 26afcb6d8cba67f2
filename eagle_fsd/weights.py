"""The one weight-format step: a model's linear layers swapped for the kind a WeightFormat (eagle_fsd.plan) names.

    float      nothing changes
    prepacked  PackedLinear (eagle_fsd.prepack): the weight packed once for oneDNN
    int4/int8  QuantLinear (eagle_fsd.quant): weight-only rounding, for a drafter's few-row forwards
    rows       RowQuantLinear (eagle_fsd.target_quant): int8 x int8 / int4 x int8 with row-rounded activations; sibling
               layers reading one input (q/k/v, gate/up) share one product, and every other parameter becomes fp32 so
               that the activations between products stay fp32

Every new layer shares its weight and bias with the layer it replaces (state_dict and tied embeddings unchanged).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from eagle_fsd.gguf_blocks import GgufBlocks
from eagle_fsd.kernels.kquant_rows import kquant_rows_available
from eagle_fsd.plan import WeightFormat
from eagle_fsd.prepack import PackedLinear
from eagle_fsd.quant import QuantLinear, int4_fits, quant_supported
from eagle_fsd.target_quant import (SIBLINGS, Rounding, RowQuantLinear, checked_activation_bits, int4_rows_available,
                                    make_product, row_int8_supported, share_product, stored)

PREPACKED = WeightFormat("prepacked")


def swap_linears(model: nn.Module, layer_for: Callable, share: Callable | None = None) -> int:
    """Each plain or prepacked nn.Linear child under `model` (not already swapped) replaced by
    layer_for(qualified name, linear), unless that returns None; share(parent, prefix) first swaps groups of a parent's
    children and returns how many. Returns how many layers were swapped."""
    swapped = 0
    for parent_name, parent in list(model.named_modules()):
        prefix = f"{parent_name}." if parent_name else ""
        if share is not None:
            swapped += share(parent, prefix)
        for name, child in list(parent.named_children()):
            if type(child) in (nn.Linear, PackedLinear) and (layer := layer_for(prefix + name, child)) is not None:
                setattr(parent, name, layer)
                swapped += 1
    return swapped


def format_weights(model: nn.Module, fmt: WeightFormat, store=None) -> int:
    """`model`'s linear layers in format `fmt`; returns how many were swapped. store: an
    eagle_fsd.product_store.ProductStore serving (and keeping) a `rows` model's products by module name."""
    if fmt.kind == "float":
        return 0
    if fmt.kind == "prepacked":
        return swap_linears(model, lambda name, linear: PackedLinear.from_linear(linear))
    if fmt.kind in ("int4", "int8"):
        return swap_weight_only(model, int(fmt.kind[3:]))
    return swap_rows(model, fmt, store)


def swap_weight_only(model: nn.Module, bits: int) -> int:
    """QuantLinear for every layer the kernel takes (int4: whole groups); the others stay as they are."""
    if not quant_supported(bits):
        raise ValueError(f"int{bits} drafting needs PyTorch's CPU weight-only kernel "
                         f"(aten._weight_int{bits}pack_mm{'_for_cpu' if bits == 4 else ''}); this PyTorch "
                         f"{torch.__version__} lacks it. Use draft_quant 'off'")

    def layer_for(name, linear):
        fits = bits == 8 or int4_fits(linear.out_features, linear.in_features)
        return QuantLinear.from_linear(linear, bits) if fits else None

    return swap_linears(model, layer_for)


def swap_rows(model: nn.Module, fmt: WeightFormat, store=None) -> int:
    """RowQuantLinear everywhere (eagle_fsd.target_quant), siblings sharing a product; every other parameter fp32.
    With `fmt.gguf`, the layers whose weights that file holds in Q4_K / Q6_K blocks run on those blocks where the
    kernel builds here (eagle_fsd.gguf_blocks)."""
    if not row_int8_supported(next(model.parameters()).device):
        raise ValueError(f"target_quant int8 needs a CPU model and PyTorch's FBGEMM int8 linear; this PyTorch "
                         f"{torch.__version__} or device lacks it. Use target_quant 'off'")
    bits = checked_activation_bits(fmt.activation_bits)
    four_bit = fmt.four_bit and int4_rows_available()
    blocks = GgufBlocks(fmt.gguf) if fmt.gguf and kquant_rows_available() else None
    rounding = Rounding(bits, fmt.exact, four_bit, fmt.requantize, blocks, fmt.int4_group)

    def share(parent, prefix):
        return sum(share_product(parent, names, rounding, store, prefix) for names in SIBLINGS)

    def layer_for(name, linear):
        product = stored(store, name, linear.weight.shape, lambda: make_product(
            linear.weight, linear.bias, rounding, name))
        return RowQuantLinear.from_weight(linear.weight, linear.bias, product=product)

    swapped = swap_linears(model, layer_for, share)
    for module in model.modules():
        if isinstance(module, RowQuantLinear):
            continue
        for param in module.parameters(recurse=False):
            if param.is_floating_point() and param.dtype != torch.float32:
                param.data = param.data.float()  # a tied embedding too: its lm_head's weight is the same tensor
    return swapped
