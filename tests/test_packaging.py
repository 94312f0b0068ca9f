"""What ComfyUI-Manager installs (requirements.txt) and what `pip install .` installs (pyproject.toml) are the same
packages with the same lower bounds; only torch differs on purpose (a bare name in requirements.txt, so a user's
CUDA build is never replaced)."""

import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def requirement(line: str) -> tuple[str, str]:
    """(normalised name, version specifier) of one requirement line."""
    match = re.fullmatch(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(.*?)\s*", line)
    assert match, f"not a plain requirement: {line!r}"
    return re.sub(r"[-_.]+", "-", match.group(1)).lower(), match.group(2).replace(" ", "")


def requirements_txt() -> dict[str, str]:
    lines = [line.split("#", 1)[0] for line in (ROOT / "requirements.txt").read_text().splitlines()]
    return dict(requirement(line) for line in lines if line.strip())


def pyproject_dependencies() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return dict(requirement(line) for line in project["dependencies"])


def test_requirements_txt_and_pyproject_list_the_same_packages():
    txt, toml = requirements_txt(), pyproject_dependencies()
    assert txt.keys() == toml.keys()
    differing = {name: (txt[name], toml[name]) for name in txt if txt[name] != toml[name]}
    assert differing == {"torch": ("", ">=2.4")}


def test_the_check_sees_a_difference():
    assert requirement("Pillow >= 10.0") == ("pillow", ">=10.0")
    assert requirement("safe_tensors>=0.4") == ("safe-tensors", ">=0.4")
