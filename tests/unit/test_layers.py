"""The import direction of DESIGN.md: layers point down only; the laptop tools stay torch-free."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "dstrain"

# Lower number = lower layer. A module may import its own layer or any lower one.
LAYERS = {
    "errors": 0,
    "hardware": 0,
    "config": 0,
    "preflight": 0.5,  # the rules `check`, `plan` and the trainer run, over our config
    "interop": 0.5,  # other engines' files; imported only by check and convert (below)
    "planner": 1,
    "deploy": 1,
    "doctor": 1,
    "model": 1,
    "data": 1,
    "metrics": 1,
    "parallel": 2,
    "bench": 2,
    "train": 3,
    "checkpoint": 3,
    "report": 3,
    "cli": 4,
    "__main__": 4,
    "__init__": 4,
}
NO_TORCH = {"errors", "hardware", "config", "preflight", "interop", "planner", "deploy"}
NO_TORCH_DISTRIBUTED = NO_TORCH | {"model", "data", "doctor"}
# The engines' own verdicts run DeepSpeed and Megatron-Core, which bring torch with them: these
# may import torch inside a function, only once the engine is installed and asked, never at
# module level (check stays torch-free without them).
ENGINE_JUDGES = {"interop/ds_initialize.py", "interop/megatron_verdict.py"}
# Only these commands read other engines' files: the trainer's floor does not carry their
# catalogues (DeepSpeed's keys, Megatron's arguments).
INTEROP_READERS = {"cli/check.py", "cli/convert.py"}


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        top = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
        if path.name == "__main__.py":
            top = "__main__"  # entry points (`python -m dstrain.train`) sit above every layer
        yield path, top, ast.parse(path.read_text())


def _imports(tree: ast.Module) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def test_every_top_level_module_has_a_layer():
    tops = {top for _, top, _ in _modules()}
    assert tops <= set(LAYERS), tops - set(LAYERS)


def test_imports_point_down():
    wrong = []
    for path, top, tree in _modules():
        for name in _imports(tree):
            parts = name.split(".")
            if parts[0] != "dstrain" or len(parts) < 2:
                continue
            if LAYERS[parts[1]] > LAYERS[top]:
                wrong.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert not wrong, wrong


def test_laptop_layers_import_no_torch():
    wrong = []
    for path, top, tree in _modules():
        if str(path.relative_to(PACKAGE)) in ENGINE_JUDGES:
            tree = ast.Module(
                body=[n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
            )
        for name in _imports(tree):
            if top in NO_TORCH and name.split(".")[0] == "torch":
                wrong.append(f"{path.relative_to(PACKAGE)} imports {name}")
            if top in NO_TORCH_DISTRIBUTED and name.startswith("torch.distributed"):
                wrong.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert not wrong, wrong


def test_only_check_and_convert_import_other_engines():
    wrong = []
    for path, top, tree in _modules():
        where = str(path.relative_to(PACKAGE))
        if top == "interop" or where in INTEROP_READERS:
            continue
        wrong += [f"{where} imports {n}" for n in _imports(tree) if n.startswith("dstrain.interop")]
    assert not wrong, wrong
