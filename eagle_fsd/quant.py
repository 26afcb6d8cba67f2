"""Weight-only int4 / int8 linear layers for drafting on a CPU.

A drafter only proposes tokens and the target verifies every one of them with its own weights, so a drafter with
rounded weights keeps decoding exactly as lossless as before; it only changes how often its proposals are accepted
(the tuner measures that, eagle_fsd.tune). A draft forward over one or two tree nodes reads each weight once, so on a
CPU its time is the bytes of weight read: int4 reads about a quarter of bf16.

    int4, per output row and group of G input columns:  w ~ (q - 8) s + z,  q in 0..15,
         s = (max - min) / 15,  z = min + 8 s   (the group's min and max map to q = 0 and q = 15)
    int8, per output row:                              w ~ q s,  q in -127..127,  s = max|w| / 127

The products run in PyTorch's CPU weight-only kernels (`aten._weight_int4pack_mm_for_cpu`,
`aten._weight_int8pack_mm`), the activations staying in the layer's dtype. Those kernels pay per row: past
MAX_QUANT_ROWS rows (a prompt prefill, a long catch-up) the layer multiplies by its original weight instead (measured
on Qwen2.5-0.5B, 2 AMD EPYC threads: int4 28 / 39 ms at 1 / 4 rows against 55 / 52 ms prepacked bf16, but 63 / 647
against 51 / 287 ms at 5 / 100 rows).
"""
from __future__ import annotations

import torch
from torch import nn

from eagle_fsd.prepack import PackedLinear, packed_linear

BITS = (4, 8)
MAX_QUANT_ROWS = 4  # more rows than this: the original weight's kernel
INT4_GROUP = 32  # columns per int4 scale and offset: the smallest group the kernel takes (finest rounding)


def quant_supported(bits: int, device: torch.device | str = "cpu") -> bool:
    """This PyTorch has the CPU weight-only kernel for `bits` and the device is a CPU."""
    if torch.device(device).type != "cpu":
        return False
    ops = torch.ops.aten
    if bits == 4:
        return hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(ops, "_convert_weight_to_int4pack_for_cpu")
    return bits == 8 and hasattr(ops, "_weight_int8pack_mm")


def int4_fits(out_features: int, in_features: int) -> bool:
    """The int4 CPU kernel's shape rules: output rows in multiples of 16, input columns in whole groups."""
    return out_features % 16 == 0 and in_features % INT4_GROUP == 0


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed q, scales and offsets [in / INT4_GROUP, out, 2]) of W (out, in); see the module docstring."""
    w = weight.detach().float()
    out_f, in_f = w.shape
    grouped = w.reshape(out_f, in_f // INT4_GROUP, INT4_GROUP)
    low, high = grouped.amin(-1), grouped.amax(-1)
    scale = (high - low).clamp(min=1e-8) / 15
    q = ((grouped - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).reshape(out_f, in_f)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    scale_offset = torch.stack([scale, low + 8 * scale], -1).transpose(0, 1).contiguous()
    return packed, scale_offset.to(weight.dtype)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 (out, in), scale per output row) of W (out, in)."""
    w = weight.detach().float()
    scale = w.abs().amax(1).clamp(min=1e-8) / 127
    return (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale.to(weight.dtype)


def dequantize(layer: "QuantLinear") -> torch.Tensor:
    """The weight the kernel multiplies by, (out, in) in float32: for tests and error bounds."""
    if layer.bits == 8:
        return layer.q.float() * layer.scale.float()[:, None]
    eye = torch.eye(layer.in_features, dtype=layer.scale.dtype)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, layer.q, INT4_GROUP, layer.scale).float().t()


class QuantLinear(nn.Linear):
    """An nn.Linear whose forward multiplies by an int4 / int8 copy of its weight (see the module docstring).
    Shares `weight` and `bias` with the layer it replaces (state_dict and tied embeddings unchanged). Inference only."""

    q: torch.Tensor
    scale: torch.Tensor
    bits: int

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int) -> QuantLinear:
        layer = cls.from_weight(linear.weight, linear.bias, bits)
        layer.packed = linear.packed if isinstance(linear, PackedLinear) else None  # for many rows
        return layer

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None, bits: int) -> QuantLinear:
        if bits not in BITS:
            raise ValueError(f"bits={bits!r}: use 4 or 8")
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.out_features, layer.in_features = weight.shape
        layer.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        layer.bias = bias
        layer.bits, layer.packed = bits, None
        layer.q, layer.scale = quantize_int4(weight) if bits == 4 else quantize_int8(weight)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            raise RuntimeError("QuantLinear runs on the CPU only; quantize the drafter after moving it")
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] > MAX_QUANT_ROWS:
            if self.packed is not None:
                return packed_linear(x, self.packed, None if self.bias is None else self.bias.detach())
            return super().forward(x)
        if self.bits == 4:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.q, INT4_GROUP, self.scale)
        else:
            y = torch.ops.aten._weight_int8pack_mm(rows, self.q, self.scale)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.detach()
