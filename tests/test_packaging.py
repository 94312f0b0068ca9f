"""What ComfyUI-Manager installs (requirements.txt) and what `pip install .` installs (pyproject.toml) are the same
packages with the same lower bounds; only torch differs on purpose (a bare name in requirements.txt, so a user's
CUDA build is never replaced)."""

import fnmatch
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


# -- the Comfy Registry's metadata (docs.comfy.org/registry/specifications; ComfyUI's comfy_config reads the same) --

REGISTRY_OS = ("Microsoft", "POSIX", "MacOS", "OS Independent")  # comfy_config: the prefixes it keeps
REGISTRY_ACCELERATORS = {"GPU :: NVIDIA CUDA", "GPU :: AMD ROCm", "GPU :: Intel Arc", "NPU :: Huawei Ascend",
                         "GPU :: Apple Metal"}
ICON_TYPES = (".svg", ".png", ".jpg", ".jpeg", ".gif")


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def svg_size(path: Path) -> tuple[float, float]:
    root = re.search(r"<svg\b[^>]*>", path.read_text(encoding="utf-8")).group(0)
    return tuple(float(re.search(rf'\b{side}="([0-9.]+)', root).group(1)) for side in ("width", "height"))


def test_registry_identity_fields():
    project, comfy = pyproject()["project"], pyproject()["tool"]["comfy"]
    # the node id: < 100 characters, letters/digits/-/_/., no two special characters in a row, a letter first
    assert re.fullmatch(r"[A-Za-z](?:[A-Za-z0-9]|[-_.](?=[A-Za-z0-9]))*", project["name"]), project["name"]
    assert len(project["name"]) < 100
    assert re.fullmatch(r"\d+\.\d+\.\d+", project["version"]), "the registry wants semantic X.Y.Z versions"
    assert project["description"].strip() and project["license"] and project["requires-python"]
    assert comfy["PublisherId"].strip() and comfy["DisplayName"].strip()


def test_registry_links_point_at_one_repository():
    urls = pyproject()["project"]["urls"]
    repository = urls["Repository"]
    assert re.fullmatch(r"https://github\.com/[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+", repository), repository
    assert urls["Issues"] == f"{repository}/issues"
    assert urls["Documentation"].startswith(f"{repository}/")


def test_registry_icon_is_a_shipped_file_of_that_repository():
    repository = pyproject()["project"]["urls"]["Repository"]
    icon = pyproject()["tool"]["comfy"]["Icon"]
    raw = repository.replace("https://github.com/", "https://raw.githubusercontent.com/") + "/main/"
    assert icon.startswith(raw), f"Icon {icon!r} is not a file of {repository} on main"
    relative = icon.removeprefix(raw)
    path = ROOT / relative
    assert path.is_file() and path.suffix in ICON_TYPES, f"{relative}: no such icon in the repository"
    width, height = svg_size(path)
    assert 0 < width <= 800 and 0 < height <= 400, "the registry shows icons up to 800 x 400"
    ignored = [line.strip().rstrip("/") for line in (ROOT / ".comfyignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    assert not [p for p in ignored if relative == p or relative.startswith(f"{p}/")], ".comfyignore drops the icon"


def test_registry_classifiers_are_ones_the_registry_reads():
    classifiers = pyproject()["project"]["classifiers"]
    systems = [c.removeprefix("Operating System :: ") for c in classifiers if c.startswith("Operating System :: ")]
    accelerators = [c.removeprefix("Environment :: ") for c in classifiers if c.startswith("Environment :: ")]
    assert systems and all(s.startswith(REGISTRY_OS) for s in systems)
    assert accelerators and set(accelerators) <= REGISTRY_ACCELERATORS


# -- what the registry archive carries (.comfyignore: git's tracked files minus these patterns) --------------------

def comfyignore_patterns() -> list[str]:
    return [line.strip() for line in (ROOT / ".comfyignore").read_text().splitlines()
            if line.strip() and not line.startswith("#")]


def archived(relative: str) -> bool:
    """Whether a repository path survives .comfyignore (gitignore-style: `dir/` drops the folder, `*` any name)."""
    parts = relative.split("/")
    for pattern in comfyignore_patterns():
        folder = pattern.endswith("/")
        pattern = pattern.rstrip("/")
        candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + (0 if folder else 1))]
        candidates += parts[:-1] if folder else parts  # a pattern without a slash matches a name at any depth
        if any(fnmatch.fnmatchcase(c, pattern) for c in candidates):
            return False
    return True


def test_the_archive_ships_the_subgraph_blueprints_and_not_their_generator():
    """ComfyUI finds blueprints at custom_nodes/<pack>/subgraphs/*.json (app/subgraph_manager.py): the folder must be
    at the root of the archive, as it is in the repository."""
    blueprints = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "subgraphs").glob("*.json"))
    assert len(blueprints) == 5 and all(archived(p) for p in blueprints), blueprints
    assert archived("workflows/text_to_image_base.json") and archived("nodes/bridge.py")
    assert not archived("workflows/build_blueprints.py") and not archived("workflows/build_workflows.py")
    assert not archived("tests/test_blueprints.py") and not archived("demo/x.py") and not archived("a/b/x.pyc")
