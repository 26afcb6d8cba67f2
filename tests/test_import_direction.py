"""One dependency direction: every module of the package is in a layer, and imports only its own layer or lower.

    kernels < tree < fsd < weights < drafting < tune < loading < engine < apps < entry

weights: how linear weights are stored and multiplied, for target and drafter alike (dtype names, oneDNN prepacking,
int4 / int8); drafting: the forward machinery (attention, cache, hf) and the drafters; tune: the cost model, which
drives a model it is given; loading: names and options to a ready model (presets, settings, the loader); engine: the
generation loop, which calls the loader it is built by (EaFsdModel.from_pretrained). Apps are siblings: chat, train
and eval (one group; eval modules may import each other) never import each other.
Imports inside functions count too: a lazy import is still a dependency."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = {"eagle_fsd": "eagle_fsd", "tree": "eagle_fsd.tree", "kernels": "eagle_fsd.kernels",
               "eval": "eagle_fsd.eval"}  # folder -> installed package (pyproject's package-dir)
LAYERS = ("kernels", "tree", "fsd", "weights", "drafting", "tune", "loading", "engine", "apps", "entry")

# A key maps that module and, if it is (or becomes) a package, every module inside it; "eagle_fsd" maps only itself.
LAYER_OF = {
    "eagle_fsd.kernels": "kernels",
    "eagle_fsd.tree": "tree",
    "eagle_fsd.fsd": "fsd",
    "eagle_fsd.divergence": "fsd",
    "eagle_fsd.sampling": "fsd",
    "eagle_fsd.dtypes": "weights",
    "eagle_fsd.prepack": "weights",
    "eagle_fsd.quant": "weights",
    "eagle_fsd.target_quant": "weights",
    "eagle_fsd.attention": "drafting",
    "eagle_fsd.cache": "drafting",
    "eagle_fsd.hf": "drafting",
    "eagle_fsd.fused_decoder": "drafting",
    "eagle_fsd.drafters": "drafting",
    "eagle_fsd.vocab": "drafting",
    "eagle_fsd.eagle3": "drafting",
    "eagle_fsd.eagle3_export": "drafting",
    "eagle_fsd.files": "drafting",  # cache_dir, sha256_file, package_file
    "eagle_fsd.tune": "tune",
    "eagle_fsd.presets": "loading",
    "eagle_fsd.settings": "loading",
    "eagle_fsd.loading": "loading",
    "eagle_fsd.product_store": "loading",  # quantized products kept in the per-machine cache
    "eagle_fsd": "engine",
    "eagle_fsd.model": "engine",
    "eagle_fsd.guard": "engine",
    "eagle_fsd.prompts": "engine",
    "eagle_fsd.tune.cli": "apps",  # `eagle-fsd tune`: loads a model; its --mtbench analysis reads the MT-Bench questions
    "eagle_fsd.chat": "apps",
    "eagle_fsd.train": "apps",
    "eagle_fsd.eval": "apps",
    "eagle_fsd.vllm": "apps",  # the vLLM plugin: FSD's rule on vLLM's draft chains
    "eagle_fsd.cli": "entry",
}
# Apps that must not import each other (a module outside these groups may be imported by any app).
APP_GROUP_OF = {"eagle_fsd.chat": "chat", "eagle_fsd.train": "train", "eagle_fsd.eval": "eval",
                 "eagle_fsd.vllm": "vllm"}


def covering_key(module: str, table: dict) -> str | None:
    """The longest key of `table` that is `module` or one of its parent packages ("eagle_fsd" only exactly)."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        key = ".".join(parts[:n])
        if key in table and (n == len(parts) or key != "eagle_fsd"):
            return key
    return None


def our_modules() -> dict[str, Path]:
    """Dotted name -> file for every module under the package folders."""
    modules = {}
    for folder, package in SOURCE_DIRS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def imported_modules(module: str, path: Path, known: set[str]) -> set[str]:
    """Our modules that `module` imports anywhere in its file (function bodies included)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1 packages
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names)
    return {name for name in found if name == "eagle_fsd" or name.startswith("eagle_fsd.")}


def violation(importer: str, imported: str) -> str | None:
    """Why `importer` may not import `imported` (None: it may)."""
    if covering_key(imported, LAYER_OF) is None:
        return None  # not a module of ours (e.g. a name imported from a package); its package is checked
    low, high = (LAYER_OF[covering_key(m, LAYER_OF)] for m in (imported, importer))
    where = f"{importer} (layer {high}) imports {imported} (layer {low})"
    if LAYERS.index(low) > LAYERS.index(high):
        return f"{where}: a module may import only its own layer or lower ({' < '.join(LAYERS)})"
    groups = [APP_GROUP_OF.get(covering_key(m, APP_GROUP_OF)) for m in (importer, imported)]
    if high == low == "apps" and None not in groups and groups[0] != groups[1]:
        return f"{where}: apps {groups[0]} and {groups[1]} are siblings and must not import each other"
    return None


def test_every_module_is_in_a_layer():
    unmapped = [m for m in our_modules() if covering_key(m, LAYER_OF) is None]
    assert not unmapped, f"classify these modules in LAYER_OF ({' < '.join(LAYERS)}): {unmapped}"


def test_imports_go_down_the_layers():
    modules = our_modules()
    problems = [why for module, path in modules.items() for imported in sorted(imported_modules(module, path,
                set(modules))) if (why := violation(module, imported)) is not None]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("importer, imported, allowed", [
    ("eagle_fsd.model", "eagle_fsd.tree.accept", True),
    ("eagle_fsd.kernels.tree_attention", "eagle_fsd.divergence", False),
    ("eagle_fsd.chat", "eagle_fsd.eval.mtbench", False),
    ("eagle_fsd.eval.sweep", "eagle_fsd.eval.mtbench", True),
    ("eagle_fsd.eval.data", "eagle_fsd.train", False),
    ("eagle_fsd.cli", "eagle_fsd.eval.bench", True),
    ("eagle_fsd.settings", "eagle_fsd.cli", False),
    ("eagle_fsd.tree.accept", "eagle_fsd.fsd", False),
    ("eagle_fsd.settings", "eagle_fsd.model", False),
    ("eagle_fsd.tune.measure", "eagle_fsd.model", False),
    ("eagle_fsd.tune.store", "eagle_fsd.presets", False),
    ("eagle_fsd.drafters", "eagle_fsd.tune", False),
    ("eagle_fsd.drafters", "eagle_fsd.prepack", True),
    ("eagle_fsd.prepack", "eagle_fsd.drafters", False),
    ("eagle_fsd.model", "eagle_fsd.loading", True),
    ("eagle_fsd.loading", "eagle_fsd.model", False),
    ("eagle_fsd.loading", "eagle_fsd.tune", True),
    ("eagle_fsd.tune.cli", "eagle_fsd.model", True),
])
def test_the_rule_itself(importer, imported, allowed):
    assert (violation(importer, imported) is None) == allowed


def test_imports_are_resolved(tmp_path):
    source = tmp_path / "accept.py"
    source.write_text("from .dynamic import DraftTree\ndef f():\n    from eagle_fsd.kernels import fused\n"
                      "    from eagle_fsd.eval import data\n    import torch\n")
    known = {"eagle_fsd.tree.dynamic", "eagle_fsd.kernels", "eagle_fsd.eval.data"}
    assert imported_modules("eagle_fsd.tree.accept", source, known) == known
