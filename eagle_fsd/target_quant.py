"""The target's linear layers in int8 (or int4 where they are 4-bit already), activations rounded to 8 bits per row
(CPU).

Decoding a model of a billion or more parameters on a few cores is bound by the bytes of weight read per forward,
and verifying a tree reads them once for all its tokens. So the target's speed is its weight bytes, as long as the
kernel keeps a few rows as cheap as one. The kernels' timings are in docs/cpu-kernels.md.

Per output channel o and input row i, with m_i = max_j |x_ij| and b bits of activation (8 on CPUs with VNNI,
else 7, so that FBGEMM's 16-bit pair sums cannot saturate):

    W_oj ~ s_o q_oj,   q in -127..127,   s_o = max_j |W_oj| / 127
    x_ij ~ m_i (u_ij - z) / r,   u_ij = round(r x_ij / m_i) + z,   r = 2^(b-1) - 1,   z = r + 1
    y_io = m_i s_o / r * sum_j q_oj (u_ij - z) + bias_o

The sum is exact in int32, and every other step is elementwise, so a row's output does not depend on the other
rows of the call: verifying a tree gives each token bit for bit what a plain decoding step of the same quantized
model gives it, provided the layer's input is bit for bit the same too. The rounding to 8 bits would turn a
last-bit difference of an fp32 sum into a whole step, so attention must not depend on how many queries and keys a
forward holds either: eagle_fsd.fused_decoder (Llama, Qwen2) sums each query over its visible keys alone, in a
fixed order; other models attend in float64 (rounded back to fp32). Decoding is lossless against that model, not
against the float weights. This rounds activations per row; llama.cpp rounds them per block of 256.

Where the weights are 4-bit already (a GGUF's Q4_K blocks, dequantized: every group of 32 inputs holds at most 16
values), `four_bit` runs them through eagle_fsd.kernels.int4_rows: W_oj = s_og q_oj + m_og per group g of 32 inputs
(q in 0..15, s and m fp16: the GGUF's values up to that rounding), the same 8-bit rows, integer sums per group and a
fixed-order fp32 sum over groups. The other layers (Q4_K_M keeps some at 6 bits) stay int8, on
eagle_fsd.kernels.int8_rows (its AVX-512 VNNI build for 8-bit activations, its AVX2 build for 7-bit ones; FBGEMM,
whose operator costs 40-70 us a call on AVX2, where neither builds). Where a GGUF file is given (WeightFormat.gguf),
the layers it holds in Q4_K / Q6_K blocks run on those blocks instead (eagle_fsd.gguf_blocks).

A drafter needs no such exactness (its rounding only moves acceptance): its int8 layers round a call's activations
with one scale over the whole call (FBGEMM's dynamic linear), its int4 groups may be coarser (Rounding.int4_group).
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from eagle_fsd.kernels.int4_rows import (CAPABILITY_ISAS, GROUP, LANES, cpu_flags, fits_int4, int4_rows_available,
                                         int4_rows_entry, int4_rows_linear, pack_int4, quantize_int4)
from eagle_fsd.kernels.int8_rows import (int8_rows_available, int8_rows_entry, int8_rows_linear, pack_int8_rows,
                                         quantize_int8)
from eagle_fsd.gguf_blocks import KQUANT_CODES, KQUANT_KINDS, KQuantProduct
from eagle_fsd.prepack import PackedLinear

VNNI_FLAGS = {"avx512_vnni", "avx_vnni", "amx_int8"}  # 8-bit products summed in 32 bits


def row_int8_supported(device: torch.device | str = "cpu") -> bool:
    """PyTorch has FBGEMM's int8 linear with fp32 input and output, and the device is a CPU."""
    if torch.device(device).type != "cpu" or "fbgemm" not in torch.backends.quantized.supported_engines:
        return False
    try:
        return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32 is not None  # resolves the op
    except (AttributeError, RuntimeError):
        return False


def activation_bits(cpu_flags: set[str]) -> int:
    """8 where the CPU sums 8-bit products in 32 bits (VNNI, AMX), else 7 (see the module docstring)."""
    return 8 if VNNI_FLAGS & cpu_flags else 7


@functools.cache
def cpu_activation_bits() -> int:
    """`activation_bits` of this CPU (the most FBGEMM's int8 products take here without saturating), capped like the
    kernels by torch's CPU capability: ATEN_CPU_CAPABILITY=avx2 takes an AVX2-only CPU's 7 (and its int8_rows build)."""
    return 7 if torch.backends.cpu.get_cpu_capability().upper() in CAPABILITY_ISAS else activation_bits(cpu_flags())


def checked_activation_bits(bits: int | None) -> int:
    """bits, or this CPU's (None); more than this CPU sums exactly is an error (its products would saturate)."""
    most = cpu_activation_bits()
    if bits is None:
        return most
    if bits not in (7, 8):
        raise ValueError(f"activation_bits={bits!r}: use 7 or 8, or None for this CPU's ({most})")
    if bits > most:
        raise ValueError(f"activation_bits={bits}: this CPU has no VNNI, so FBGEMM sums 8-bit products in 16 bits and "
                         f"would saturate; use {most} (or None, this CPU's)")
    return bits


def pack_int8(weight: torch.Tensor):
    """W (out, in) rounded per output channel to int8 and packed for FBGEMM."""
    w = weight.detach().float()
    scale = (w.abs().amax(1).clamp(min=1e-12) / 127).double()
    with warnings.catch_warnings():  # PyTorch marks its quantized tensors deprecated; FBGEMM's linear reads them
        warnings.simplefilter("ignore", UserWarning)
        q = torch.quantize_per_channel(w, scale, torch.zeros(w.shape[0], dtype=torch.long), 0, torch.qint8)
    return torch.ops.quantized.linear_prepack(q, None)


class Int8Product:
    """x -> x W^T + b in fp32 through W rounded per output channel and each row of x rounded with its own scale
    (the module docstring); per_row False: all rows of a call with one (a drafter's layers). Row-rounded layers run
    eagle_fsd.kernels.int8_rows where its build for their activation bits runs here (rows_kernel None), or where
    rows_kernel is True; FBGEMM elsewhere."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, activation_bits: int | None = None,
                 per_row: bool = True, rows_kernel: bool | None = None):
        activation_bits = checked_activation_bits(activation_bits)
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach().float()  # added after the row scale
        self.activation_bits = activation_bits
        self.levels = 2 ** (activation_bits - 1) - 1  # r: the largest |u - z|
        self.per_row = per_row
        self.rows_kernel = per_row and (int8_rows_available(activation_bits) if rows_kernel is None else rows_kernel)
        if self.rows_kernel:
            self.packed, self.qsum, self.scale = pack_int8_rows(*quantize_int8(weight))
            self.padded_bias = None if bias is None else F.pad(self.bias, (0, self.scale.numel() - self.out_features))
        else:
            self.packed = pack_int8(weight)

    def state(self) -> dict[str, torch.Tensor]:
        """The tensors `from_state` rebuilds this product from without its weight: codes, scales, bias and
        `info` = (8, out, in, activation bits, per row, int8_rows)."""
        info = torch.tensor([8, self.out_features, self.in_features, self.activation_bits, self.per_row,
                             self.rows_kernel])
        if self.rows_kernel:
            tensors = {"packed": self.packed, "qsum": self.qsum, "scale": self.scale}
        else:  # FBGEMM's packed weight is opaque: its int8 codes and per-channel scales
            weight, _ = torch.ops.quantized.linear_unpack(self.packed)
            tensors = {"codes": weight.int_repr(), "scale": weight.q_per_channel_scales()}
        return {"info": info, **tensors, **({} if self.bias is None else {"bias": self.bias})}

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor]) -> Int8Product:
        """The product `state` describes, bit for bit the one it came from."""
        product = cls.__new__(cls)
        _, product.out_features, product.in_features, bits, per_row, rows_kernel = state["info"].tolist()
        product.activation_bits, product.per_row, product.rows_kernel = bits, bool(per_row), bool(rows_kernel)
        product.levels = 2 ** (bits - 1) - 1
        product.bias = state.get("bias")
        if product.rows_kernel:
            product.packed, product.qsum, product.scale = state["packed"], state["qsum"], state["scale"]
            product.padded_bias = None if product.bias is None else \
                F.pad(product.bias, (0, product.scale.numel() - product.out_features))
        else:
            codes = state["codes"]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                weight = torch._make_per_channel_quantized_tensor(
                    codes, state["scale"], torch.zeros(codes.shape[0], dtype=torch.long), 0)
            product.packed = torch.ops.quantized.linear_prepack(weight, None)
        return product

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            raise RuntimeError("int8 layers run on the CPU only; quantize the target after moving it")
        if self.rows_kernel:
            return int8_rows_linear(x, self.packed, self.qsum, self.scale, self.out_features, self.padded_bias,
                                    bits=self.activation_bits)
        rows = x.reshape(-1, self.in_features).float()
        if not self.per_row:  # u = round((x - lo) / s), s = (hi - lo) / 255 over the call (/ 127 for 7 bits)
            y = torch.ops.quantized.linear_dynamic(rows, self.packed, self.activation_bits < 8)
            y = y if self.bias is None else y.add_(self.bias)
            return y.reshape(*x.shape[:-1], self.out_features)
        peak = rows.abs().amax(1, keepdim=True).clamp_(min=1e-30)
        y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
            rows / peak, 1.0 / self.levels, self.levels + 1, self.packed)
        y = y.mul_(peak) if self.bias is None else torch.addcmul(self.bias, y, peak)
        return y.reshape(*x.shape[:-1], self.out_features)


class Int4Product:
    """x -> x W^T + b in fp32 through W rounded to 4 bits per group of 32 inputs (scale and minimum in fp16) and each
    row of x rounded to 8 bits with its own scale (eagle_fsd.kernels.int4_rows). For weights that are 4-bit already
    (a GGUF's Q4 blocks, dequantized: `fits_int4`); rows independent as in Int8Product. `group`: inputs per scale
    where they divide the row (a drafter's coarser groups: fewer bytes a forward), else 32."""

    activation_bits, per_row = 8, True

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: int = GROUP):
        self.out_features, self.in_features = weight.shape
        self.packed = pack_int4(*quantize_int4(weight, group if self.in_features % group == 0 else GROUP))
        self.bias = None if bias is None else bias.detach().float()

    group = property(lambda self: self.in_features // self.packed.shape[1])

    def state(self) -> dict[str, torch.Tensor]:
        """The packed codes, bias and `info` = (4, out, in, 8, 1, 0), from which `from_state` rebuilds this product."""
        info = torch.tensor([4, self.out_features, self.in_features, 8, 1, 0])
        return {"info": info, "packed": self.packed, **({} if self.bias is None else {"bias": self.bias})}

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor]) -> Int4Product:
        product = cls.__new__(cls)
        product.out_features, product.in_features = state["info"].tolist()[1:3]
        product.packed, product.bias = state["packed"], state.get("bias")
        return product

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            raise RuntimeError("int4 layers run on the CPU only; quantize the target after moving it")
        return int4_rows_linear(x, self.packed, self.out_features, self.bias)


def runs_int4(weight: torch.Tensor, four_bit: bool, requantize: bool) -> bool:
    """Whether a weight runs the int4 kernel (8-bit activations on AVX-512 VNNI and AVX2): `four_bit` asks for it, this
    CPU has it, and the weight is 4-bit already or, with `requantize`, may be rounded to 4 bits (whole groups)."""
    if not (four_bit and int4_rows_available()):
        return False
    return weight.shape[1] % GROUP == 0 if requantize else fits_int4(weight)


def product_kind(name: str, weight: torch.Tensor, rounding: Rounding) -> str:
    """What the layer `name` runs on: "q4_k" / "q6_k" where `rounding.blocks` (an eagle_fsd.gguf_blocks.GgufBlocks)
    holds its weight in those blocks, else "int4" where `runs_int4` says so, else "int8"."""
    kind = None if rounding.blocks is None else rounding.blocks.kind(name)
    return kind or ("int4" if runs_int4(weight, rounding.four_bit, rounding.requantize) else "int8")


def make_product(weight: torch.Tensor, bias: torch.Tensor | None, rounding: Rounding, name: str = "", kind=None):
    """A KQuantProduct, Int4Product or Int8Product as `kind` (default: `product_kind`) says (the first two round rows
    one by one whatever `rounding.per_row` says: in C++ that costs nothing)."""
    kind = kind or product_kind(name, weight, rounding)
    if kind in KQUANT_CODES:
        return KQuantProduct(kind, rounding.blocks.raw(name, weight), bias)
    if kind == "int4":
        return Int4Product(weight, bias, rounding.int4_group)
    return Int8Product(weight, bias, rounding.activation_bits, rounding.per_row)


class SharedInputProduct:
    """One product over the stacked weights of sibling layers that read the same input (q/k/v, gate/up), computed
    once per input tensor: fewer, larger calls, each row's result unchanged (its scale and sums are its own)."""

    def __init__(self, product, readers: int):
        self.product = product
        self.activation_bits, self.per_row = product.activation_bits, product.per_row
        self.readers = readers  # sibling layers reading each product: once all have, it is dropped (memory)
        self.last_input, self.last_version, self.last_output, self.unread = None, -1, None, 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x is not self.last_input or x._version != self.last_version:  # another tensor, or changed in place
            self.last_input, self.last_version, self.last_output = x, x._version, self.product(x)
            self.unread = self.readers
        output = self.last_output
        self.unread -= 1
        if self.unread <= 0:
            self.last_input, self.last_output = None, None
        return output


def own_product(product):
    """The KQuantProduct / Int4Product / Int8Product behind `product` (a SharedInputProduct's, or itself)."""
    return product.product if isinstance(product, SharedInputProduct) else product


def kernel_call(product) -> tuple[int, list[torch.Tensor], int] | None:
    """How eagle_fsd.kernels.decoder_glue.rows_forward calls a KQuantProduct, Int4Product or int8_rows Int8Product
    from C++: (the kernel's entry address, [packed, qsum, scale, bias] (empty where unused), groups or chunks); None
    for a product it cannot call (FBGEMM, or outputs that are not whole blocks of 16 channels)."""
    empty = torch.empty(0)
    if product.out_features % LANES:
        return None
    if isinstance(product, (KQuantProduct, Int4Product)):
        bias = empty if product.bias is None else product.bias.contiguous()
        entry = product.entry() if isinstance(product, KQuantProduct) else int4_rows_entry()
        return entry, [product.packed, empty, empty, bias], product.packed.shape[1]
    if isinstance(product, Int8Product) and product.rows_kernel:
        bias = empty if product.padded_bias is None else product.padded_bias.contiguous()
        tensors = [product.packed, product.qsum, product.scale, bias]
        return int8_rows_entry(product.activation_bits), tensors, product.packed.shape[1]
    return None


class RowQuantLinear(nn.Linear):
    """An nn.Linear computing y = x W^T + b through an Int8Product or Int4Product (its own, or columns of one shared
    with its siblings), in fp32 whatever the weight's dtype, returned in the input's dtype. Shares `weight` and `bias`
    with the layer it replaces (state_dict, tied embeddings and a draft vocabulary's slices unchanged). Inference only,
    CPU only."""

    @classmethod
    def from_linear(cls, linear: nn.Linear, activation_bits: int | None = None, per_row: bool = True) -> RowQuantLinear:
        return cls.from_weight(linear.weight, linear.bias, activation_bits, per_row=per_row)  # shared, not copied

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None, activation_bits: int | None = None,
                    product=None, columns: slice | None = None, per_row: bool = True,
                    rounding: Rounding | None = None) -> RowQuantLinear:
        """A layer over `weight`; with `product`, the `columns` of that (shared) product instead of its own, else its
        own made as `rounding` says (default: int8 with `activation_bits`, `per_row`)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.out_features, layer.in_features = weight.shape
        layer.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        layer.bias = bias
        layer.product = product or make_product(weight, bias, rounding or Rounding(activation_bits, per_row))
        layer.columns = columns
        layer.activation_bits = layer.product.activation_bits
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.product(x)
        return (y if self.columns is None else y[..., self.columns]).to(x.dtype)


SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # layers of one module reading one input


def product_from_state(state: dict[str, torch.Tensor]):
    """The KQuantProduct, Int4Product or Int8Product whose `state()` this is."""
    code = int(state["info"][0])
    return {4: Int4Product, 8: Int8Product}.get(code, KQuantProduct).from_state(state)


def state_kind(state: dict[str, torch.Tensor]) -> str:
    """`product_kind`'s name for the product whose `state()` this is."""
    code = int(state["info"][0])
    return {4: "int4", 8: "int8"}.get(code) or KQUANT_KINDS[code]


def stored(store, name: str, shape: torch.Size, build):
    """`build()`, or the product a store (eagle_fsd.product_store.ProductStore; None: no store) keeps under `name`
    for a weight of `shape`."""
    return build() if store is None else store.product(name, tuple(shape), build)


@dataclass(frozen=True)
class Rounding:
    """How the weight step makes a layer's product (`make_product`'s settings): int8 products' activation bits, rows
    rounded one by one (per_row), int4 where a weight is 4-bit already (four_bit) or wherever it has whole groups
    (requantize) in groups of `int4_group` inputs, a GGUF's own blocks where `blocks` (an
    eagle_fsd.gguf_blocks.GgufBlocks) holds the layer."""

    activation_bits: int | None = None
    per_row: bool = True
    four_bit: bool = False
    requantize: bool = False
    blocks: object = None
    int4_group: int = GROUP


def share_product(parent: nn.Module, names: tuple[str, ...], rounding: Rounding, store=None, prefix: str = "") -> int:
    """The linear layers `names` of `parent`, if all there with one input width, become RowQuantLinear columns of
    SharedInputProducts made as `rounding` says, one per `product_kind` among them; returns how many. store, prefix:
    products are kept in / read from `store` as "{prefix}q_proj+k_proj+v_proj" and the like."""
    layers, blocks = [getattr(parent, name, None) for name in names], rounding.blocks
    if not all(type(layer) in (nn.Linear, PackedLinear) for layer in layers) \
            or len({layer.in_features for layer in layers}) != 1:
        return 0
    kept = None if store is None else store.kinds(prefix, {name: tuple(layer.weight.shape)
                                                          for name, layer in zip(names, layers)})
    kinds = [kept[name] for name in names] if kept else [
        product_kind(prefix + name, layer.weight, rounding) for name, layer in zip(names, layers)]
    for kind in dict.fromkeys(kinds):
        members = [(name, layer) for name, layer, k in zip(names, layers, kinds) if k == kind]

        def build(members=members, kind=kind):
            biases = None
            if any(layer.bias is not None for _, layer in members):
                biases = torch.cat([layer.bias.detach().float() if layer.bias is not None
                                    else torch.zeros(layer.out_features) for _, layer in members])
            if kind in KQUANT_CODES:  # a GGUF's rows are independent: siblings' blocks stack
                return KQuantProduct(kind, torch.cat([blocks.raw(prefix + name, layer.weight)
                                                      for name, layer in members]), biases)
            return make_product(torch.cat([layer.weight.detach() for _, layer in members]), biases, rounding,
                                kind=kind)

        shape = (sum(layer.out_features for _, layer in members), members[0][1].in_features)
        name = prefix + "+".join(name for name, _ in members)
        product = SharedInputProduct(stored(store, name, shape, build), readers=len(members))
        start = 0
        for name, layer in members:
            columns = slice(start, start + layer.out_features)
            setattr(parent, name, RowQuantLinear.from_weight(layer.weight, layer.bias, product=product,
                                                             columns=columns))
            start += layer.out_features
    return len(layers)


def weight_share(model: nn.Module, counts) -> float:
    """The fraction of a quantized model's linear weights in products for which `counts(product)` holds (0: none)."""
    products = {id(m.product): m.product for m in model.modules() if isinstance(m, RowQuantLinear)}.values()
    inner = [own_product(p) for p in products]
    total = sum(p.out_features * p.in_features for p in inner)
    return sum(p.out_features * p.in_features for p in inner if counts(p)) / total if total else 0.0


def int4_share(model: nn.Module) -> float:
    """The fraction of a quantized model's linear weights that run 4-bit (int4 or a GGUF's Q4_K blocks)."""
    return weight_share(model, lambda p: isinstance(p, Int4Product) or getattr(p, "kind", "") == "q4_k")


def gguf_share(model: nn.Module) -> float:
    """The fraction of a quantized model's linear weights that run on a GGUF's own blocks (KQuantProduct)."""
    return weight_share(model, lambda p: isinstance(p, KQuantProduct))


def runs_int8_rows(model: nn.Module) -> bool:
    """Some of a quantized model's int8 layers run eagle_fsd.kernels.int8_rows (not FBGEMM)."""
    products = (own_product(m.product) for m in model.modules() if isinstance(m, RowQuantLinear))
    return any(isinstance(p, Int8Product) and p.rows_kernel for p in products)
