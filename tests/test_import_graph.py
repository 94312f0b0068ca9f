"""The shipped code's floor plan: `model/` and `nodes/` import each other one way only. No import cycle between
modules, no import from a lower layer to a higher one (the layers below), and no module reaching into another
module's underscore names. Read with `ast` from the files, so it holds without importing anything."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted(p for folder in ("model", "nodes") for p in (ROOT / folder).rglob("*.py"))

#: Lowest first. A module may import its own unit and any unit listed before it, never one after it.
LAYERS = (
    ("model",),  # model/__init__.py (imports nothing)
    ("model.vae.latents",),  # the latent convention, read by everything above it
    ("model.layers",),
    ("model.memory.slots",),  # the slot ring (torch only): a host-side prefix cache streams through it
    ("model.prefix_cache",),  # the prefix cache's data and lifecycle: below the DiT that fills and reads it
    ("model.transformer",),
    ("model.vae",),
    ("model.encoders",),
    ("model.loaders",),
    ("model.memory",),
    ("model.sampling.step_cache",),  # the step cache's rule (a block hook): its feature module declares it
    ("model.features",),  # one module per feature: the record's fields, the table of pairs, each run's parts
    ("model.sampling",),
    ("model.parallel",),  # Ulysses over several processes: runs the sampling loop on each rank
    ("model.options",),  # the options record on a model copy and the table of feature pairs
    ("nodes.comfy_standin",),
    ("nodes.bridge",),
    ("nodes.socket_types", "nodes.validation"),
    ("nodes.placement",),
    ("nodes",),
)


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def imports(path: Path, root: Path = ROOT) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for every pack-internal import of `path` (relative imports)."""
    name = module_name(path, root)
    package = name.split(".") if is_package(path) else name.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
            names = [a.name for a in node.names]
            where = [root.joinpath(*target.split("."), n) for n in names]
            submodules = [f"{target}.{n}" for n, w in zip(names, where)
                          if w.with_suffix(".py").is_file() or (w / "__init__.py").is_file()]
            if submodules:  # `from . import bridge`: the module itself
                found += [(m, [], node.lineno) for m in submodules]
            else:
                found.append((target, names, node.lineno))
    return found


def unit_of(module: str) -> int:
    best = None
    for rank, units in enumerate(LAYERS):
        for unit in units:
            if (module == unit or module.startswith(unit + ".")) and (best is None or len(unit) > len(best[1])):
                best = (rank, unit)
    assert best is not None, f"{module} is in no layer of LAYERS: add it"
    return best[0]


GRAPH = {module_name(p): imports(p) for p in SHIPPED}


def test_every_module_has_a_layer():
    for module in GRAPH:
        unit_of(module)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_import_runs_back_up(path):
    here = module_name(path)
    upward = [f"line {line}: {target}" for target, _, line in GRAPH[here]
              if target in GRAPH and not (here == "nodes" and target.startswith("nodes."))
              and unit_of(target) > unit_of(here)]
    assert upward == [], f"{here} imports from a higher layer"


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_private_names_taken_from_another_module(path):
    here = module_name(path)
    private = [f"line {line}: {target}.{n}" for target, names, line in GRAPH[here] for n in names
               if n.startswith("_") and not n.startswith("__")]
    assert private == []


def test_model_never_imports_nodes():
    for module, found in GRAPH.items():
        if module.startswith("model"):
            assert not [t for t, _, _ in found if t.startswith("nodes")], module


def test_no_import_cycle():
    edges = {m: {t for t, _, _ in found if t in GRAPH and t != m} for m, found in GRAPH.items()}
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for t in sorted(edges[m]):
            if state.get(t) == "open":
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(t):] + [t]))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m)


def test_the_checks_catch_what_they_are_for(tmp_path):
    """In a throwaway tree: an import running back up and a private name are seen as such."""
    (tmp_path / "model" / "layers").mkdir(parents=True)
    (tmp_path / "model" / "sampling").mkdir()
    (tmp_path / "model" / "layers" / "a.py").write_text("from ..sampling.b import thing\n")
    (tmp_path / "model" / "sampling" / "b.py").write_text("from ..layers import a\nfrom ..layers.a import _hidden\n")
    a = imports(tmp_path / "model" / "layers" / "a.py", tmp_path)
    b = imports(tmp_path / "model" / "sampling" / "b.py", tmp_path)
    assert a == [("model.sampling.b", ["thing"], 1)]
    assert b == [("model.layers.a", [], 1), ("model.layers.a", ["_hidden"], 2)]
    assert unit_of("model.sampling.b") > unit_of("model.layers.a")  # so a.py's import runs back up
