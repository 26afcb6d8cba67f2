"""Linear layers with weights packed once for oneDNN (CPU, fp32 or bf16).

`F.linear` on a bf16 CPU tensor hands the weight to oneDNN in its plain row-major layout, and oneDNN reorders it
into its blocked layout on every call. For the few rows of a decode or verification step that reorder is a large
share of the matmul. Reordering once at load time (what Inductor's weight freezing does) removes it: y = x W^T + b,
the same product and the same kernel, with the weight already in the layout the kernel reads.

In fp32, `F.linear` goes to MKL's sgemm instead, whose few-row path is slow on AMD CPUs: on a 2-vCPU AMD EPYC,
1536 -> 8960 took 3.7 / 7.7 / 8.7 ms at 1 / 4 / 8 rows with MKL and 2.6 / 2.4 / 2.5 ms with oneDNN's packed kernel
(benchmarks/prepack_probes/fp32_linear.py); on the Intel Xeon of earlier figures MKL won at 1 row. So packing is
chosen by measurement ("auto", eagle_fsd.tune.dtype). fp32 packed results equal `F.linear`'s up to the order of the
fp32 sums (in the probe, max |difference| 1e-4 to 5e-4 on outputs of standard deviation 40 to 95), not bit for bit.

A `PackedLinear` shares its weight and bias with the `nn.Linear` it replaces (eagle_fsd.weights swaps them: state_dict,
`.weight` and tied embeddings are unchanged) and keeps a packed copy beside them (one more copy of the linear weights in
memory). CPU only: a packed layer raises if its input is not on the CPU.
"""
from __future__ import annotations

import torch
from torch import nn


def prepack_supported(dtype: torch.dtype, device: torch.device | str) -> bool:
    """oneDNN can pack this: a CPU model in fp32, or in bf16 on a CPU where oneDNN supports bf16 (AVX-512 BF16 or
    AMX)."""
    if torch.device(device).type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    ops = torch.ops.mkldnn
    if not (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise")):
        return False
    return dtype == torch.float32 or bool(ops._is_mkldnn_bf16_supported())


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """W (out, in) in oneDNN's blocked layout for a linear layer (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b with W from `pack_weight`; x of any leading shape."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Linear):
    """An nn.Linear whose forward reads a packed copy of its weight (see the module docstring). Inference only:
    the packed copy does not follow later changes to `weight`."""

    packed: torch.Tensor

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> PackedLinear:
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.in_features, layer.out_features = linear.in_features, linear.out_features
        layer.weight, layer.bias = linear.weight, linear.bias  # shared, not copied
        layer.packed = pack_weight(linear.weight)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            raise RuntimeError("PackedLinear holds a CPU-packed weight; load the model on the device instead of "
                               "moving a prepacked one")
        return packed_linear(x, self.packed, None if self.bias is None else self.bias.detach())
