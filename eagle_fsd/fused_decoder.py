"""A Llama-family decoder's forward with the steps between its products as single C++ calls
(eagle_fsd.kernels.decoder_glue), for fp32 models on a CPU: the target and the LM drafter.

A decoding or draft forward holds a few tokens, so on a CPU with low-bit weights its products are cheap (a 0.5B
drafter in int4 reads ~0.3 GB) and what surrounds them is not: transformers' layers spend about a hundred small
operators and several Python wrappers per layer on RMSNorm, the rotary embedding, attention, the gated MLP and the
plumbing between them, a few microseconds each. This forward calls the model's products (sibling layers sharing
one product as one call), embedding and rotary tables, and per layer

    h = RMSNorm_1(x);  q, k = rope(W_q h), rope(W_k h);  v = W_v h;  x += W_o attention(q, k, v)
    h = RMSNorm_2(x);  x += W_down (silu(W_gate h) * W_up h)

then the final RMSNorm. rope and silu * up round as transformers' operators do. A float target (`exact`, attending
through SDPA) runs transformers' norm operators (called from C++); the others run one C++ loop per norm, each row
alone, summed in another order.

Attention: a forward on top of a cached prefix (tree verification, a plain step, a draft level, a catch-up) of a
drafter or of a quantized target (`rows_attend`) ropes, stores and attends in one C++ call per layer
(decoder_glue.attend): fp32, each query over its visible keys in slot order, so a token gets the same bits in a tree
as in a plain step, which is what makes a quantized target's verification lossless against its own plain decoding
(its 8-bit rounding of activations would turn a last-bit difference into a whole step). The prompt (no prefix:
many rows, where SDPA's blocked products pay) and float targets attend through the engine's attention function: a
float target's hidden states then equal transformers' forward to the bit, and its greedy output is transformers'
own. Supported: fp32 Llama and Qwen2 decoders without sliding windows, where the extension builds.

One call: where every layer product is one of our own kernels (int4_rows and int8_rows, wherever they build), a
forward on top of a cached prefix is a single C++ call (decoder_glue.rows_forward, planned once per model by
`RowsPlan`): the same steps on the same operands in the same order, so the same bits, without the ~60 operators and
Python calls per layer between them. A drafter (all int4) and a quantized target take it wherever the kernels build;
FBGEMM's int8 layers (no build of int8_rows here), float targets and EAGLE-3 features run layer by layer.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch

from eagle_fsd.attention import ForwardState, eagle_fsd_attention, layer_windows
from eagle_fsd.cache import TreeCache
from eagle_fsd.kernels.decoder_glue import (attend, decoder_glue_available, rms_norm, rms_norm_like_transformers,
                                            rope, rows_forward, silu_mul)
from eagle_fsd.plan import ModelRun
from eagle_fsd.target_quant import RowQuantLinear, SharedInputProduct, kernel_call
from eagle_fsd.target_quant import own_product as inner_product

FUSED_MODEL_TYPES = ("llama", "qwen2")
FUSED_VERSION = 4  # 4: a few-row forward of own kernels in one C++ call (RowsPlan); 3: attention over the cache in
# C++ (rows_attend); profiles of 1 time another forward, of 2 a drafter whose deeper draft levels saw earlier levels'
# entries that were not their ancestors


def fused_fits(model) -> bool:
    """The model's layers are the Llama shape this forward runs (pre-norm attention and SiLU-gated MLP, full
    attention, no extra norms), its activations fp32 on a CPU, and the extension builds here: the loader's test for
    eagle_fsd.plan.ModelRun.fused."""
    config = model.config
    if config.model_type not in FUSED_MODEL_TYPES or config.hidden_act != "silu":
        return False
    norm = model.get_decoder().norm.weight
    if norm.dtype != torch.float32 or norm.device.type != "cpu":
        return False
    return all(window is None for window in layer_windows(config)) and decoder_glue_available()


class LayerPlan:
    """A decoder layer's products as the forward calls them: q | k | v and gate | up each as one product where the
    siblings share one (eagle_fsd.target_quant.SharedInputProduct, columns in order), else their modules side by
    side; o and down likewise called directly. Built once per layer, rebuilt when the layer's modules are replaced
    (e.g. quantized)."""

    def __init__(self, layer):
        self.modules = linears(layer)
        self.qkv = shared_product(self.modules[:3])
        self.gate_up = shared_product(self.modules[3:5])
        self.o, self.down = own_product(self.modules[5]), own_product(self.modules[6])

    def fits(self, layer) -> bool:
        return self.modules == linears(layer)


def linears(layer) -> tuple:
    attention, mlp = layer.self_attn, layer.mlp
    return (attention.q_proj, attention.k_proj, attention.v_proj, mlp.gate_proj, mlp.up_proj, attention.o_proj,
            mlp.down_proj)


def own_product(layer):
    """A RowQuantLinear's own product (fp32 in and out, as the layer returns it for fp32 input), else the layer."""
    if isinstance(layer, RowQuantLinear) and layer.columns is None \
            and not isinstance(layer.product, SharedInputProduct):
        return layer.product
    return layer


def shared_product(siblings):
    """The product behind sibling RowQuantLinear layers that read one input, if it is one shared product whose columns
    are theirs in order (x -> their outputs side by side); else None."""
    product = siblings[0].product if isinstance(siblings[0], RowQuantLinear) else None
    if not isinstance(product, SharedInputProduct):
        return None
    stop = 0
    for layer in siblings:
        if not (isinstance(layer, RowQuantLinear) and layer.product is product
                and layer.columns is not None and layer.columns.start == stop):
            return None
        stop = layer.columns.stop
    return product.product if product.product.out_features == stop else None


_plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # decoder layer -> LayerPlan


def layer_plan(layer) -> LayerPlan:
    plan = _plans.get(layer)
    if plan is None or not plan.fits(layer):
        plan = _plans[layer] = LayerPlan(layer)
    return plan


PARTS = ((0, 1, 2), (5,), (3, 4), (6,))  # LayerPlan.modules of q | k | v, o, gate | up, down: rows_forward's parts


class RowsPlan:
    """A decoder as eagle_fsd.kernels.decoder_glue.rows_forward runs it, in one C++ call per forward: every layer
    product an own kernel (`kernel_call`: int4_rows, or int8_rows where it runs), each part's products writing their
    columns side by side in module order. `calls` is None where some product is not such a kernel (FBGEMM, a float
    layer) or the norms differ in epsilon: the forward then runs layer by layer from Python."""

    def __init__(self, decoder, plans: list[LayerPlan]):
        self.plans = plans
        self.checked_at = _module_registrations[0]
        self.cache_layers = [layer.self_attn.layer_idx for layer in decoder.layers]
        self.calls, self.weights = [], []
        norms = [m for layer in decoder.layers for m in (layer.input_layernorm, layer.post_attention_layernorm)]
        norms.append(decoder.norm)
        self.norms = [m.weight.detach() for m in norms]
        self.eps = norms[-1].variance_epsilon
        if any(m.variance_epsilon != self.eps for m in norms):
            self.calls = None
            return
        for index, plan in enumerate(plans):
            for part, members in enumerate(PARTS):
                placed = placed_products([plan.modules[i] for i in members])
                if placed is None:
                    self.calls = None
                    return
                for product, offset in placed:
                    entry, tensors, inner = kernel_call(product)
                    self.calls.append([index, part, entry, product.in_features, tensors[0].shape[0], inner, offset])
                    self.weights += tensors

    def fits(self, plans: list[LayerPlan]) -> bool:
        return len(plans) == len(self.plans) and all(a is b for a, b in zip(plans, self.plans))


def placed_products(modules) -> list[tuple[object, int]] | None:
    """The kernel products behind sibling layers whose outputs sit side by side in module order, each with the column
    where its output starts: a shared product must cover its readers' columns exactly, in order. None where a layer is
    not a packed RowQuantLinear or its product not a `kernel_call` one."""
    placed, offset = [], 0  # [product, where its output starts, columns its readers cover]
    for module in modules:
        if not isinstance(module, RowQuantLinear):
            return None
        product = inner_product(module.product)
        if kernel_call(product) is None:
            return None
        first = 0 if module.columns is None else module.columns.start
        if first == 0:
            placed.append([product, offset, 0])
        if not placed or placed[-1][0] is not product or placed[-1][1] + first != offset:
            return None
        placed[-1][2] += module.out_features
        offset += module.out_features
    if any(covered != product.out_features for product, _, covered in placed):
        return None
    return [(product, start) for product, start, _ in placed]


_one_call = [True]


@contextlib.contextmanager
def layer_by_layer():
    """Inside, forwards run layer by layer from Python, never as one rows_forward call: its reference (tests, A/Bs)."""
    _one_call[0] = False
    try:
        yield
    finally:
        _one_call[0] = True


_rows_plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # decoder -> RowsPlan
_module_registrations = [0]  # submodules assigned anywhere in the process (a layer swapped for a quantized one, ...)


def _count_registration(module, name, submodule):
    _module_registrations[0] += 1


torch.nn.modules.module.register_module_module_registration_hook(_count_registration)


def rows_plan(decoder) -> RowsPlan:
    """The decoder's RowsPlan, checked against its layers again only when some module was assigned since (a check
    reads every layer's seven linears, ~0.2 ms a forward)."""
    plan = _rows_plans.get(decoder)
    if plan is not None and plan.checked_at == _module_registrations[0]:
        return plan
    plans = [layer_plan(layer) for layer in decoder.layers]
    if plan is None or not plan.fits(plans):
        plan = _rows_plans[decoder] = RowsPlan(decoder, plans)
    plan.checked_at = _module_registrations[0]
    return plan


def fused_decoder_forward(model, input_ids: torch.Tensor, cache, attention_mask: torch.Tensor,
                          positions: torch.Tensor, run: ModelRun = ModelRun(fused=True),
                          feature_layers: tuple[int, ...] | None = None):
    """The final-norm hidden states (n, H) of input_ids (n,) at `positions` (n,), appended to `cache`, under the
    explicit (1, 1, n, cache_len + n) bool mask: eagle_fsd.hf.decoder_forward's contract. run: how the model runs
    (`run.rows_attend` says which attention; a float target, `run.exact`, equals transformers' forward to the bit). With
    `feature_layers`, (those states, cat(hidden state entering layer i for i in feature_layers) (n, len * H)) as
    eagle_fsd.hf.decoder_outputs returns them (EAGLE-3; entering layer L, past the last, is the final-norm state).
    On top of a cached prefix the whole forward is one C++ call where `RowsPlan` allows (the same steps and bits as
    layer by layer, which `layer_by_layer()` keeps, for tests and A/Bs)."""
    decoder = model.get_decoder()
    start = cache.get_seq_length()
    # on top of a cached prefix (verification, plain steps, draft levels, catch-up); a prompt goes to SDPA
    in_rows = start > 0 and run.backend == "auto" and isinstance(cache, TreeCache) and run.rows_attend
    visible = attention_mask[0, 0].contiguous() if in_rows else None  # (n, start + n): committed prefix, tree
    x = decoder.embed_tokens(input_ids)
    cos, sin = decoder.rotary_emb(x[None], positions[None])
    cos, sin = cos[0].contiguous(), sin[0].contiguous()
    if in_rows and _one_call[0] and feature_layers is None:
        plan = rows_plan(decoder)
        if plan.calls is not None:
            return rows_in_one_call(decoder, plan, x, cache, (cos, sin), start, visible, model.config)
    layers = LayerByLayer(cache, start, attention_mask, visible, (cos, sin), input_ids.numel(), model.config,
                          ForwardState(run.backend, fp64=run.fp64_attention),
                          like_transformers=run.exact and not run.rows_attend)  # a float target: transformers' bits
    return layers.forward(decoder, x, feature_layers)


@dataclass
class LayerByLayer:
    """What the layers of one layer-by-layer forward share: the cache they append to and its length before this
    forward, the mask, the rows' visible keys (None: attention through the engine's attention function instead of
    decoder_glue.attend over the cache), the rope tables (cos, sin) at the rows' positions, the number of rows, the
    model config, the attention's forward state, and which norm (transformers' own operators, or one C++ loop)."""

    cache: object
    start: int
    attention_mask: torch.Tensor
    visible: torch.Tensor | None
    rope_tables: tuple[torch.Tensor, torch.Tensor]
    n: int
    config: object
    state: ForwardState
    like_transformers: bool = False

    def forward(self, decoder, x: torch.Tensor, feature_layers: tuple[int, ...] | None):
        """The final-norm states of the rows `x` (n, H); with feature_layers, also the states entering those layers."""
        entering = None if feature_layers is None else []  # the states entering each layer, for EAGLE-3 only
        for layer in decoder.layers:
            if entering is not None:
                entering.append(x)
            x = self.layer(layer, x)
        last = self.norm(decoder.norm, x)
        if feature_layers is None:
            return last
        entering.append(last)
        return last, torch.cat([entering[i] for i in feature_layers], dim=-1)

    def norm(self, module, x: torch.Tensor) -> torch.Tensor:
        if self.like_transformers:
            return rms_norm_like_transformers(x, module.weight, module.variance_epsilon)
        return rms_norm(x, module.weight, module.variance_epsilon)

    def layer(self, layer, x: torch.Tensor) -> torch.Tensor:
        """One decoder layer: attention, then the gated MLP, each added to the residual stream."""
        plan = layer_plan(layer)
        h = self.norm(layer.input_layernorm, x)
        if self.visible is not None:
            out = self.attend_over_cache(layer.self_attn, plan, h)
        else:
            out = self.attend_through_engine(layer.self_attn, h)
        x = x + plan.o(out)
        h = self.norm(layer.post_attention_layernorm, x)
        if plan.gate_up is not None:
            gate_up = plan.gate_up(h)
            gate, up = gate_up.split(gate_up.shape[-1] // 2, -1)
        else:
            gate, up = layer.mlp.gate_proj(h), layer.mlp.up_proj(h)
        return x + plan.down(silu_mul(gate, up))

    def attend_over_cache(self, attention, plan: LayerPlan, h: torch.Tensor) -> torch.Tensor:
        """Rope, store and attend in one C++ call (decoder_glue.attend) on top of the cached prefix."""
        storage = self.cache.layers[attention.layer_idx]
        start, n = self.start, self.n
        if start + n > storage.max_len:
            raise RuntimeError(f"KV cache overflow: {start + n} tokens > preallocated {storage.max_len}")
        qkv = plan.qkv(h) if plan.qkv is not None else torch.cat([m(h) for m in plan.modules[:3]], -1)
        out = attend(qkv, *self.rope_tables, storage.keys, storage.values, start, self.visible,
                     self.config.num_attention_heads, self.config.num_key_value_heads, attention.scaling)
        storage.length = start + n
        return out

    def attend_through_engine(self, attention, h: torch.Tensor) -> torch.Tensor:
        """Rope q and k, append k and v to the cache, attend through the engine's attention function (SDPA)."""
        cos, sin = self.rope_tables
        n, kv_heads = self.n, self.config.num_key_value_heads
        q = rope(attention.q_proj(h), cos, sin, self.config.num_attention_heads)
        k = rope(attention.k_proj(h), cos, sin, kv_heads)
        v = attention.v_proj(h).view(1, n, kv_heads, -1).transpose(1, 2)
        k, v = self.cache.update(k, v, attention.layer_idx)
        out, _ = eagle_fsd_attention(attention, q, k, v, self.attention_mask, scaling=attention.scaling,
                                     eagle_fsd_forward=self.state)
        return out.reshape(n, -1)


def rows_in_one_call(decoder, plan: RowsPlan, x, cache, rope_tables: tuple, start: int, visible,
                     config) -> torch.Tensor:
    """fused_decoder_forward's rows on top of a cached prefix through decoder_glue.rows_forward; rope_tables: (cos,
    sin) at the rows' positions."""
    storages = [cache.layers[i] for i in plan.cache_layers]
    n = x.shape[0]
    if start + n > storages[0].max_len:
        raise RuntimeError(f"KV cache overflow: {start + n} tokens > preallocated {storages[0].max_len}")
    last = rows_forward(x.float().contiguous(), plan.calls, plan.weights, plan.norms, plan.eps, *rope_tables,
                        [s.keys for s in storages], [s.values for s in storages], start, visible,
                        config.num_attention_heads, config.num_key_value_heads, decoder.layers[0].self_attn.scaling,
                        config.intermediate_size)
    for storage in storages:
        storage.length = start + n
    return last
