"""A GGUF file's own Q4_K and Q6_K blocks as a quantized target's products (eagle_fsd.kernels.kquant_rows).

A preset's target is converted from a GGUF Q4_K_M file. Rounding its dequantized weights again (eagle_fsd.target_quant)
reads 5.0 bits a weight for the Q4_K tensors (an fp16 scale and minimum per 32) and 8 for the Q6_K ones (per-channel
int8, which moves their values). Read from the file, the same layers take the GGUF's own blocks, repacked but not
rounded: 4.6 and 6.6 bits a weight (about the 4.5 and 6.56 llama.cpp reads), the GGUF's values exactly. Activations
are rounded to 8 bits per row and summed per super-block in int32, then in fp32 in a fixed order, so rows stay
independent of their call as with the other row products (verification equals plain decoding bit for bit).

    Q4_K  W_oj = d_ot sc_og q_oj - dmin_ot mn_og   q in 0..15, 6-bit sc, mn per 32 inputs g, fp16 d, dmin per 256 t
    Q6_K  W_oj = d_ot sc_og (q_oj - 32)            q in 0..63, int8 sc per 16 inputs

A module's tensor is found by name (`gguf_tensor_name`) and checked against the weight the model loaded: the same
values to that weight's rounding, on sampled rows, or a ValueError naming both.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from eagle_fsd.kernels.kquant_rows import (BLOCK_BYTES, GGML_TYPES, SUPER, dequantize, kquant_rows_entry,
                                           kquant_rows_isa, kquant_rows_linear, pack)

KQUANT_CODES = {"q4_k": 14, "q6_k": 16}  # a product state's info[0] (4 and 8 are int4 and int8)
KQUANT_KINDS = {code: kind for kind, code in KQUANT_CODES.items()}
LAYER_TENSORS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}  # transformers' Llama / Qwen2 module -> llama.cpp's tensor
CHECKED_ROWS = 64  # rows of each tensor compared with the loaded weight
# The kernel builds on which the blocks beat rounding again. The AVX2 build is compute-bound at 3-8 rows: 1.14-1.42x
# int4_rows' / int8_rows' AVX2 time there, 0.85-1.01x at one row (benchmarks/kquant_kernels_ab.py avx2, an AVX-512
# EPYC), so a tree's verification would cost more than the bytes save.
PAYING_BUILDS = ("avx512_vnni",)


def blocks_pay() -> bool:
    """The kernel build this machine runs is one on which a GGUF's blocks measured faster (PAYING_BUILDS)."""
    return kquant_rows_isa() in PAYING_BUILDS


def gguf_tensor_name(module_name: str) -> str | None:
    """llama.cpp's name of the weight of the linear layer `module_name` (a Llama / Qwen2-style decoder's), or None."""
    if module_name == "lm_head":
        return "output.weight"
    match = re.fullmatch(r"model\.layers\.(\d+)\.(\w+\.\w+)", module_name)
    if match is None or match.group(2) not in LAYER_TENSORS:
        return None
    return f"blk.{match.group(1)}.{LAYER_TENSORS[match.group(2)]}.weight"


class GgufBlocks:
    """The Q4_K and Q6_K tensors of one GGUF file (memory-mapped), served by the module name of the layer they hold."""

    def __init__(self, path: str | Path):
        from gguf import GGUFReader

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file {self.path} not found: fetch it with `eagle-fsd models gguf NAME`")
        kinds = {ggml_type: kind for kind, ggml_type in GGML_TYPES.items()}
        self.tensors = {t.name: (kinds[t.tensor_type], t.data) for t in GGUFReader(str(self.path)).tensors
                        if t.tensor_type in kinds}

    def kind(self, module_name: str) -> str | None:
        """"q4_k" or "q6_k": the block format of the layer's tensor; None where the file holds no such tensor."""
        found = self.tensors.get(gguf_tensor_name(module_name) or "")
        return None if found is None else found[0]

    def raw(self, module_name: str, weight: torch.Tensor) -> torch.Tensor:
        """The layer's blocks, (out, in / 256 * block bytes) uint8, checked to hold `weight` (ValueError if not)."""
        kind, data = self.tensors[gguf_tensor_name(module_name)]
        raw = torch.from_numpy(data.copy())
        shape = (raw.shape[0], raw.shape[1] // BLOCK_BYTES[kind] * SUPER)
        if shape != tuple(weight.shape):
            raise ValueError(f"{self.path.name}: {gguf_tensor_name(module_name)} is {shape}, {module_name}'s weight "
                             f"{tuple(weight.shape)}: this GGUF is not the model's; pass the GGUF it was converted "
                             "from")
        rows = torch.linspace(0, shape[0] - 1, min(CHECKED_ROWS, shape[0])).long()
        values, loaded = dequantize(kind, raw[rows]), weight.detach()[rows].double()
        if not torch.allclose(values, loaded, rtol=2.0 ** -7, atol=0):  # bf16 keeps 8 bits: within 2^-8 of each
            raise ValueError(f"{self.path.name}: {gguf_tensor_name(module_name)} does not hold {module_name}'s weight "
                             "(its values differ): this GGUF is not the model's; pass the GGUF it was converted from")
        return raw


class KQuantProduct:
    """x -> x W^T + b in fp32 through W in a GGUF's own Q4_K or Q6_K blocks (`kind`), each row of x rounded to 8 bits
    with its own scale (eagle_fsd.kernels.kquant_rows); rows independent as in target_quant.Int8Product."""

    activation_bits, per_row = 8, True

    def __init__(self, kind: str, raw: torch.Tensor, bias: torch.Tensor | None):
        self.kind = kind
        self.out_features, self.in_features = raw.shape[0], raw.shape[1] // BLOCK_BYTES[kind] * SUPER
        self.packed = pack(kind, raw)
        self.bias = None if bias is None else bias.detach().float()

    def state(self) -> dict[str, torch.Tensor]:
        """The packed blocks, bias and `info` = (code, out, in, 8, 1, 0), from which `from_state` rebuilds it."""
        info = torch.tensor([KQUANT_CODES[self.kind], self.out_features, self.in_features, 8, 1, 0])
        return {"info": info, "packed": self.packed, **({} if self.bias is None else {"bias": self.bias})}

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor]) -> KQuantProduct:
        product = cls.__new__(cls)
        code, product.out_features, product.in_features = state["info"].tolist()[:3]
        product.kind = KQUANT_KINDS[code]
        product.packed, product.bias = state["packed"], state.get("bias")
        return product

    def entry(self) -> int:
        """The address of its kernel's C entry (eagle_fsd.kernels.decoder_glue's layer loop calls it)."""
        return kquant_rows_entry(self.kind)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            raise RuntimeError("GGUF block layers run on the CPU only; quantize the target after moving it")
        return kquant_rows_linear(x, self.packed, self.kind, self.out_features, self.bias)
