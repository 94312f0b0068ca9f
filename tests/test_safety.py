"""The shipped pack follows the ComfyUI registry rules: weights only through safetensors; no network, no
subprocess, no eval/exec, no environment reads. Checked by reading every shipped Python file's AST, so a
comment or a string that mentions these words does not count, and an aliased import still does."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = [ROOT / "__init__.py", *sorted((ROOT / "model").rglob("*.py")), *sorted((ROOT / "nodes").rglob("*.py"))]

FORBIDDEN_MODULES = {"subprocess", "socket", "urllib", "http", "requests", "httpx", "aiohttp", "pickle", "dill",
                     "shelve", "marshal", "ftplib", "smtplib"}
FORBIDDEN_CALLS = {"eval", "exec", "compile", "__import__", "getenv", "putenv", "system", "popen", "load",
                   "urlopen"}
FORBIDDEN_ATTRIBUTES = {("os", "environ"), ("os", "getenv"), ("os", "system"), ("os", "popen"), ("torch", "load"),
                        ("os", "environb")}


def _violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.split(".")[0] in FORBIDDEN_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in FORBIDDEN_MODULES:
            found.append(f"from {node.module} import ...")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if (node.value.id, node.attr) in FORBIDDEN_ATTRIBUTES:
                found.append(f"{node.value.id}.{node.attr}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FORBIDDEN_CALLS:
            found.append(f"{node.func.id}(...)")
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
    finally:
        globals()["ROOT"] = original


def test_weights_load_only_through_safetensors():
    """Every place that reads weights uses safetensors' lazy reader; nothing calls torch.load or unpickles."""
    readers = [p for p in SHIPPED if "safe_open" in p.read_text()]
    assert {p.name for p in readers} >= {"dit_loading.py", "vae_loading.py", "text_encoder_loading.py"}


def test_comfyignore_keeps_dev_files_out_of_the_archive():
    ignored = (ROOT / ".comfyignore").read_text().split()
    for folder in ("tests/", "benchmarks/", "demo/", ".ci/"):
        assert folder in ignored
