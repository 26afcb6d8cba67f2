"""Quantized products kept on disk. Rounding and packing a 1.5B target's weights (eagle_fsd.target_quant) takes
minutes of a small CPU at every load, yet a product depends only on its weight and the settings: so each is built
once per model folder and settings, saved in one safetensors file in the per-machine cache, and read back
memory-mapped by later loads, bit for bit the product built."""
from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from eagle_fsd.files import cache_dir
from eagle_fsd.kernels.int4_rows import int4_rows_isa
from eagle_fsd.kernels.int8_rows import int8_rows_builds
from eagle_fsd.plan import WeightFormat
from eagle_fsd.target_quant import product_from_state, state_kind
from eagle_fsd.weights import format_weights

STORE_VERSION = 3  # the products' layouts (pack_int4, pack_int8_rows, kquant_rows.pack, state()); bump on a change
WEIGHT_FILES = (".safetensors", ".bin", ".json")  # what a model folder's weights (and their shapes) live in


def model_source(model: torch.nn.Module) -> dict | None:
    """{"folder": the local folder `model` was loaded from, "weights": its weight files' names, sizes and
    modification times}; None for a model not loaded from a local folder."""
    name = model.name_or_path or ""
    folder = Path(name)
    if not name or not folder.is_dir():
        return None
    weights = sorted([f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in folder.iterdir()
                     if f.suffix in WEIGHT_FILES)
    return {"folder": str(folder.resolve()), "weights": weights}


def products_path(model: torch.nn.Module, fmt: WeightFormat) -> Path | None:
    """Where `format_weights(model, fmt)` (a `rows` format) keeps its products: a file per `model_source` (folder
    and weight files), weight dtype, settings, kernel builds and STORE_VERSION; None for a model not loaded from a
    local folder."""
    source = model_source(model)
    if source is None:
        return None
    key = {"source": source, "dtype": str(next(model.parameters()).dtype), "settings": settings_of(fmt),
           "int4_build": int4_rows_isa(), "int8_rows": int8_rows_builds(), "version": STORE_VERSION}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "products" / f"{Path(source['folder']).name}-{digest}.safetensors"


class ProductStore:
    """The products saved at `path` (none if it is missing or unreadable), served by module name, and the ones built
    since, which `save` adds to the file."""

    def __init__(self, path: Path, source: dict | None = None):
        self.path = Path(path)
        self.source = source  # model_source of the weights, recorded in the file
        self.saved: dict[str, dict[str, torch.Tensor]] = {}
        self.built: dict[str, object] = {}
        self.served = 0
        try:
            tensors = load_file(self.path) if self.path.is_file() else {}
        except (SafetensorError, OSError, ValueError):
            tensors = {}  # a damaged file is rebuilt
        for key, tensor in tensors.items():
            name, field = key.rsplit("/", 1)
            self.saved.setdefault(name, {})[field] = tensor

    def product(self, name: str, shape: tuple[int, int], build):
        """The product saved under `name` for a weight of `shape` (out, in), else `build()`, kept for `save`."""
        state = self.saved.get(name)
        if state is not None and tuple(state["info"].tolist()[1:3]) == tuple(shape):
            self.served += 1
            return product_from_state(state)
        product = self.built[name] = build()
        return product

    def kinds(self, prefix: str, shapes: dict[str, tuple[int, int]]) -> dict[str, str] | None:
        """{layer: its product's kind (target_quant.product_kind)} for sibling layers (`shapes`: name -> weight shape)
        whose products are all saved, as columns of products named "{prefix}a+b" over exactly these layers and shapes;
        else None. (Which siblings are 4-bit already takes a scan of their weights; the saved products tell it.)"""
        found = {}
        for name, state in self.saved.items():
            members = name[len(prefix):].split("+") if name.startswith(prefix) else []
            if not members or not set(members) <= shapes.keys():
                continue
            out = sum(shapes[member][0] for member in members)
            if state["info"].tolist()[1:3] != [out, shapes[members[0]][1]]:
                return None
            found |= {member: state_kind(state) for member in members}
        return found if found.keys() == shapes.keys() else None

    def save(self) -> None:
        """Writes every product, saved and built, to `path` (a temp file renamed into place) if any was built."""
        if not self.built:
            return
        states = {**self.saved, **{name: product.state() for name, product in self.built.items()}}
        tensors = {f"{name}/{field}": tensor.contiguous() for name, state in states.items()
                   for field, tensor in state.items()}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        metadata = {"format": "eagle-fsd products", "version": str(STORE_VERSION), "source": json.dumps(self.source)}
        save_file(tensors, str(tmp), metadata=metadata)
        os.replace(tmp, self.path)
        self.saved, self.built = states, {}
        self.drop_replaced()

    def drop_replaced(self) -> None:
        """Deletes the other product files of this folder made from weight files that are no longer there (the
        model fetched or converted again): no load can be served from them."""
        if self.source is None:
            return
        for other in self.path.parent.glob(f"{Path(self.source['folder']).name}-*.safetensors"):
            try:
                with safe_open(str(other), framework="pt") as f:
                    source = json.loads((f.metadata() or {}).get("source") or "null")
            except (SafetensorError, OSError, ValueError):
                continue
            if other != self.path and source and source["folder"] == self.source["folder"] \
                    and source["weights"] != self.source["weights"]:
                other.unlink(missing_ok=True)


def settings_of(fmt: WeightFormat) -> dict:
    """The settings a `rows` format's products depend on."""
    gguf = None if fmt.gguf is None else Path(fmt.gguf)
    return {"activation_bits": fmt.activation_bits, "exact": fmt.exact, "four_bit": fmt.four_bit,
            "requantize": fmt.requantize, "int4_group": fmt.int4_group,
            "gguf": None if gguf is None else [str(gguf.resolve()), gguf.stat().st_size, gguf.stat().st_mtime_ns]}


def format_cached(model: torch.nn.Module, fmt: WeightFormat) -> int:
    """`format_weights(model, fmt)` with a `rows` model's products read from and added to the per-machine cache
    (`products_path`) when the model comes from a local folder; a cache that cannot be written costs the next load
    its time, nothing else."""
    path = products_path(model, fmt) if fmt.quantized_rows else None
    store = None if path is None else ProductStore(path, model_source(model))
    swapped = format_weights(model, fmt, store)
    if store is not None:
        try:
            store.save()
        except OSError as error:
            warnings.warn(f"could not keep the quantized weights in {path} ({error}); the next load rounds them again")
    return swapped
