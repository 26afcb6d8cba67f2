"""One dependency direction: every module of the package is in a layer, and imports only its own layer or lower.

    kernels < tree < fsd < weights < drafting < tune < loading < engine < apps < entry

weights: how linear weights are stored and multiplied, for target and drafter alike (dtype names, oneDNN prepacking,
int4 / int8, the run plan and the one weight-format step); drafting: the forward machinery (attention, cache, hf) and
the proposers (eagle_fsd.drafting); tune: the cost model, which
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
    "eagle_fsd.gguf_blocks": "weights",  # a GGUF's own blocks as target products
    "eagle_fsd.plan": "weights",  # the run plan: how a model runs, decided once
    "eagle_fsd.weights": "weights",  # the one weight-format step
    "eagle_fsd.attention": "drafting",
    "eagle_fsd.cache": "drafting",
    "eagle_fsd.hf": "drafting",
    "eagle_fsd.fused_decoder": "drafting",
    "eagle_fsd.drafting": "drafting",
    "eagle_fsd.vocab": "drafting",
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
    "eagle_fsd.steps": "engine",
    "eagle_fsd.prompts": "engine",
    "eagle_fsd.tune_cli": "apps",  # `eagle-fsd tune`: loads a model; its --mtbench analysis reads the MT-Bench questions
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
    ("eagle_fsd.drafting.lm", "eagle_fsd.tune", False),
    ("eagle_fsd.drafting.base", "eagle_fsd.prepack", True),
    ("eagle_fsd.prepack", "eagle_fsd.drafting", False),
    ("eagle_fsd.cache", "eagle_fsd.plan", True),
    ("eagle_fsd.plan", "eagle_fsd.cache", False),
    ("eagle_fsd.model", "eagle_fsd.loading", True),
    ("eagle_fsd.loading", "eagle_fsd.model", False),
    ("eagle_fsd.loading", "eagle_fsd.tune", True),
    ("eagle_fsd.tune_cli", "eagle_fsd.model", True),
])
def test_the_rule_itself(importer, imported, allowed):
    assert (violation(importer, imported) is None) == allowed


def test_imports_are_resolved(tmp_path):
    source = tmp_path / "accept.py"
    source.write_text("from .dynamic import DraftTree\ndef f():\n    from eagle_fsd.kernels import fused\n"
                      "    from eagle_fsd.eval import data\n    import torch\n")
    known = {"eagle_fsd.tree.dynamic", "eagle_fsd.kernels", "eagle_fsd.eval.data"}
    assert imported_modules("eagle_fsd.tree.accept", source, known) == known


# ----------------------------------------------------------------------------- structure
PACKAGE_DIRS = ("eagle_fsd", "tree", "kernels")
PROBES = ("is_prepacked", "is_target_quantized", "quant_bits", "runs_fused", "FP64_ATTENTION", "use_packed",
          "use_quant", "switched_off")  # how a model runs is read from its run plan (eagle_fsd.plan), never probed
MAX_ATTRIBUTE_PROBES = 20
MAX_PARAMETERS = 8
WIDE_BY_CONTRACT = {"from_pretrained", "generate", "eagle_fsd_attention"}  # public kwargs; HF's attention interface
MAX_LOOP_LINES = 30


def package_trees():
    for folder in PACKAGE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield path, ast.parse(path.read_text(), str(path))


def import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` (module -> modules it imports) as a list of modules, or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for child in sorted(graph.get(node, ())):
            if state.get(child) == "open":
                return stack[stack.index(child):] + [child]
            if child not in state and (found := visit(child)):
                return found
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def parameter_count(function: ast.FunctionDef) -> int:
    args = function.args
    names = [a.arg for a in args.posonlyargs + args.args]
    count = len(names) + len(args.kwonlyargs) + (args.vararg is not None) + (args.kwarg is not None)
    return count - (bool(names) and names[0] in ("self", "cls"))


def test_no_import_cycle():
    """Function-level imports included: a lazy import still ties two modules together. A package's __init__ is left
    out as an importer (it re-exports its own modules) but not as a module imported."""
    modules = our_modules()
    graph = {module: {m for m in imported_modules(module, path, set(modules)) if m in modules and m != module}
             for module, path in modules.items() if path.name != "__init__.py"}
    assert import_cycle(graph) is None, " -> ".join(import_cycle(graph))


def test_import_cycle_is_found():
    assert import_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert import_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_probes_of_how_a_model_runs():
    found = [f"{path.relative_to(ROOT)}: {name}" for path, _ in package_trees() for name in PROBES
             if name in path.read_text()]
    assert not found, found


def test_few_attribute_probes():
    calls = [f"{path.relative_to(ROOT)}:{node.lineno}" for path, tree in package_trees() for node in ast.walk(tree)
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")]
    assert len(calls) <= MAX_ATTRIBUTE_PROBES, calls


def test_no_function_takes_more_than_eight_parameters():
    wide = [f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({parameter_count(node)})"
            for path, tree in package_trees() if path.is_relative_to(ROOT / "eagle_fsd") for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name not in WIDE_BY_CONTRACT
            and parameter_count(node) > MAX_PARAMETERS]
    assert not wide, wide


def test_parameter_count():
    tree = ast.parse("def f(self, a, b=1, *args, c, **kw): pass\ndef g(a, /, b): pass")
    assert [parameter_count(f) for f in tree.body] == [5, 2]


def test_the_loop_is_short():
    tree = ast.parse((ROOT / "eagle_fsd" / "model.py").read_text())
    loop = next(node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == "_generate")
    assert loop.end_lineno - loop.lineno + 1 <= MAX_LOOP_LINES


# ----------------------------------------------------------------------------- size
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 50  # def line to last line; a nested function counts on its own (and inside its parent)


def source_files():
    """Every module of the package folders (eagle_fsd, tree, kernels, eval)."""
    for folder in SOURCE_DIRS:
        yield from sorted((ROOT / folder).rglob("*.py"))


def function_lines(function: ast.FunctionDef) -> int:
    return function.end_lineno - function.lineno + 1


def test_no_file_over_400_lines():
    long = [f"{path.relative_to(ROOT)}: {lines} lines" for path in source_files()
            if (lines := path.read_text().count("\n")) > MAX_FILE_LINES]
    assert not long, f"split these files (at most {MAX_FILE_LINES} lines):\n" + "\n".join(long)


def test_no_function_over_50_lines():
    long = [f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {function_lines(node)} lines"
            for path in source_files() for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and function_lines(node) > MAX_FUNCTION_LINES]
    assert not long, f"split these functions (at most {MAX_FUNCTION_LINES} lines):\n" + "\n".join(long)
