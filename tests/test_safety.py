"""The shipped pack follows the ComfyUI registry rules: weights only through safetensors; no network, no
subprocess, no eval/exec, no environment reads. Checked by reading every shipped Python file's AST, so a
comment or a string that mentions these words does not count, and an aliased import still does."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = [ROOT / "__init__.py", *sorted((ROOT / "model").rglob("*.py")), *sorted((ROOT / "nodes").rglob("*.py"))]

FORBIDDEN_MODULES = {"subprocess", "socket", "urllib", "http", "requests", "httpx", "aiohttp", "pickle", "dill",
                     "shelve", "marshal", "ftplib", "smtplib",
                     # what gets around the checks below: dynamic imports, native calls, other process launchers,
                     # other unpicklers, and Hub/HTTP clients
                     "importlib", "ctypes", "multiprocessing", "pty", "cloudpickle", "joblib", "huggingface_hub",
                     "urllib3", "websocket", "websockets"}
FORBIDDEN_CALLS = {"eval", "exec", "compile", "__import__", "getenv", "putenv", "system", "popen", "load",
                   "urlopen"}
# The one exception: nodes/bridge.py serves the pack's read-only routes (/qi21/route_key, /qi21/caches, /qi21/metrics)
# on ComfyUI's own aiohttp server, so it takes aiohttp's response classes, and nothing else of aiohttp (no client).
SERVING_FILE, SERVING_NAMES = "nodes/bridge.py", {"web.json_response", "web.Response"}
# Dotted names after import aliases are resolved (`import torch as t; t.load` is `torch.load`, `from os import
# environ` is `os.environ`); entries ending in "*" are prefixes (os.execv, os.spawnl, os.forkpty, ...).
FORBIDDEN_NAMES = {"os.environ", "os.environb", "os.getenv", "os.putenv", "os.system", "os.popen", "os.exec*",
                   "os.spawn*", "os.posix_spawn*", "os.fork*", "os.startfile", "torch.load", "torch.serialization.load",
                   "numpy.load"}


def _aliases(tree) -> dict[str, str]:
    """Local name -> the module or object it stands for, from the file's absolute imports."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]  # `import a.b` binds `a`
                names[alias.asname or top] = alias.name if alias.asname else top
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _dotted(node, aliases) -> str | None:
    """`a.b.c` with `a` resolved through the imports, or None for anything but a name or an attribute chain."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([aliases.get(node.id, node.id), *reversed(parts)])


def _forbidden_name(name: str | None) -> bool:
    return name is not None and any(name == f or (f.endswith("*") and name.startswith(f[:-1])) for f in FORBIDDEN_NAMES)


def _serving_import(path: Path, node) -> bool:
    """`from aiohttp import web` in the serving file (its uses are checked by `_serving_violations`)."""
    return (path.relative_to(ROOT).as_posix() == SERVING_FILE and isinstance(node, ast.ImportFrom) and
            node.module == "aiohttp" and [(a.name, a.asname) for a in node.names] == [("web", None)])


def _serving_violations(tree) -> list[str]:
    """Any use of `web` other than its response classes (a `web.ClientSession`, a `web.TCPSite`, ...)."""
    used = {f"web.{n.attr}" for n in ast.walk(tree) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name) and n.value.id == "web"}
    return sorted(used - SERVING_NAMES)


def _violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    aliases = _aliases(tree)
    found = []
    if any(_serving_import(path, node) for node in ast.walk(tree)):
        found += _serving_violations(tree)
    for node in ast.walk(tree):
        if _serving_import(path, node):
            continue
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.split(".")[0] in FORBIDDEN_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in FORBIDDEN_MODULES:
            found.append(f"from {node.module} import ...")
        elif isinstance(node, (ast.Attribute, ast.Name)) and isinstance(node.ctx, ast.Load):
            name = _dotted(node, aliases)
            if _forbidden_name(name) and not (isinstance(node, ast.Name) and name == node.id):
                found.append(name)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FORBIDDEN_CALLS:
            found.append(f"{node.func.id}(...)")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "from_pretrained":
            # transformers downloads from the Hugging Face Hub unless told not to
            local = [k for k in node.keywords if k.arg == "local_files_only"]
            if not (local and isinstance(local[0].value, ast.Constant) and local[0].value.value is True):
                found.append("from_pretrained(...) without local_files_only=True")
    return [f"{path.relative_to(ROOT)}:{v}" for v in found]


def test_the_shipped_files_are_found():
    assert len(SHIPPED) > 10 and all(p.is_file() for p in SHIPPED)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_network_subprocess_eval_env_or_pickle(path):
    assert _violations(path) == []


def test_the_checker_catches_what_it_is_for(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import subprocess as sp\nimport os\nx = os.environ['A']\nimport torch\ntorch.load('f')\neval('1')\n"
                   "from urllib.request import urlopen\n")
    original = globals()["ROOT"]
    globals()["ROOT"] = tmp_path
    try:
        assert len(_violations(bad)) == 5
        sneaky = tmp_path / "sneaky.py"
        sneaky.write_text("import torch as t\nimport torch\nimport os\nfrom os import environ, execv\n"
                          "import importlib\nt.load('f')\ntorch.serialization.load('f')\nexecv('a', [])\n"
                          "os.spawnl(0, 'a')\n"
                          "x = environ\nTokenizer.from_pretrained('Qwen/Qwen3-VL-8B-Instruct')\n"
                          "Tokenizer.from_pretrained('folder', local_files_only=True)\nimport ctypes\n")
        assert sorted(v.split(":", 1)[1] for v in _violations(sneaky)) == sorted([
            "import importlib", "import ctypes", "torch.load", "torch.serialization.load", "os.execv", "os.spawnl",
            "os.environ", "from_pretrained(...) without local_files_only=True"])
    finally:
        globals()["ROOT"] = original


def test_only_the_bridge_takes_aiohttp_and_only_its_response_classes(tmp_path):
    original = globals()["ROOT"]
    globals()["ROOT"] = tmp_path
    try:
        (tmp_path / "nodes").mkdir()
        serving = tmp_path / "nodes" / "bridge.py"
        serving.write_text("from aiohttp import web\nweb.json_response({})\nweb.Response(body=b'')\n")
        assert _violations(serving) == []
        serving.write_text("from aiohttp import web\nweb.ClientSession()\n")
        assert _violations(serving) == ["nodes/bridge.py:web.ClientSession"]
        other = tmp_path / "nodes" / "other.py"
        other.write_text("from aiohttp import web\n")
        assert _violations(other) == ["nodes/other.py:from aiohttp import ..."]
    finally:
        globals()["ROOT"] = original


def test_weights_load_only_through_safetensors():
    """Every place that reads weights uses safetensors' lazy reader; nothing calls torch.load or unpickles."""
    readers = [p for p in SHIPPED if "safe_open" in p.read_text()]
    assert {str(p.relative_to(ROOT)) for p in readers} >= {"model/loaders/dit.py", "model/loaders/vae.py",
                                                         "model/loaders/text_encoder.py"}


def test_comfyignore_keeps_dev_files_out_of_the_archive():
    ignored = (ROOT / ".comfyignore").read_text().split()
    for folder in ("tests/", "benchmarks/", "demo/", ".ci/"):
        assert folder in ignored
