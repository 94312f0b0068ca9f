"""A real ComfyUI server with this pack installed, for tests/test_comfyui_server.py and tests/test_comfyui_browser.py.

Test settings (environment variables read only by the tests):
    QI21_COMFYUI          path to a ComfyUI checkout (the folder holding main.py). Unset: the tests skip.
    QI21_COMFYUI_PYTHON   the interpreter that runs it (default: the one running pytest); it needs ComfyUI's
                          requirements and this pack's runtime dependencies.

One server serves every test of the session (`server_for(request)` in a session fixture, or `shared_server()`):
a temporary base directory (`--base-directory`) holds models/ (the tiny random checkpoints of
demo/tiny_checkpoints.py), input/ (the images the example workflows load), output/, user/ and
custom_nodes/<pack> (a symlink to this repository), so the developer's own ComfyUI folders are never touched.
The server listens on a free port of 127.0.0.1 only, its log goes to <base>/comfyui.log, and it is stopped (by
its process id) at the end of the session.

Where the ComfyUI interpreter cannot import torchvision or torchaudio (they cannot be installed beside the local CPU
build of torch), the empty stand-ins in tests/comfyui/stubs/ are put on the server's PYTHONPATH: ComfyUI imports
them at start-up, this pack never does.
"""

import copy
import importlib
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STUBS = Path(__file__).resolve().parent / "stubs"
ENV_COMFYUI, ENV_PYTHON = "QI21_COMFYUI", "QI21_COMFYUI_PYTHON"
PACKAGE = "qi21"  # the name tests/conftest.py registers the repository under

#: The folders ComfyUI serves a pack's example workflows from (app/custom_node_manager.py); API files are in api/.
UI_WORKFLOW_FOLDERS = ("example_workflows", "workflows")
API_WORKFLOW_FOLDER = REPO / "workflows" / "api"

START_TIMEOUT_S = 240
PROMPT_TIMEOUT_S = 600

SAMPLERS = ("QI21Sampler", "QI21TurboSampler")
#: Sizes of the shrunk copies of the example workflows: seconds on a CPU with the tiny checkpoints.
SMALL_SIDE = 256  # the samplers' minimum width/height
SMALL_STEPS = 3
#: Reference images are written at 320x256 (81,920 pixels, above the vision processor's 65,536 minimum) and
#: referenced at resolution 288: area ~288^2 at aspect 5:4 resizes them to exactly 320x256.
INPUT_IMAGE_SIZE = (320, 256)
SMALL_REFERENCE_RESOLUTION = 288


def pack_dir_name() -> str:
    """The folder name the pack gets under custom_nodes/: the registry name (hyphenated, so not a valid Python
    module name, as with most real installs)."""
    try:
        text = (REPO / "pyproject.toml").read_text()
    except OSError:
        text = ""
    found = re.search(r'^name\s*=\s*"([A-Za-z0-9._-]+)"', text, re.MULTILINE)
    return found.group(1) if found else "ComfyUI-QwenImage21"


# -- settings ---------------------------------------------------------------------------------------------------
def configured_comfyui() -> tuple[Path, str]:
    """(ComfyUI folder, its interpreter), or a pytest skip saying what to set."""
    value = os.environ.get(ENV_COMFYUI, "").strip()
    if not value:
        pytest.skip(f"no ComfyUI configured: set {ENV_COMFYUI} to a ComfyUI checkout (and {ENV_PYTHON} to its "
                    "python); see the docstring of tests/test_comfyui_server.py")
    folder = Path(value).expanduser().resolve()
    if not (folder / "main.py").is_file():
        pytest.skip(f"{ENV_COMFYUI}={value} is not a ComfyUI checkout (no main.py there)")
    python = os.environ.get(ENV_PYTHON, "").strip() or sys.executable
    if not Path(python).exists() and shutil.which(python) is None:
        pytest.fail(f"{ENV_PYTHON}={python}: no such interpreter")
    return folder, python


def ui_workflows() -> list[Path]:
    files = []
    for folder in UI_WORKFLOW_FOLDERS:
        files += sorted((REPO / folder).glob("*.json"))
    return files


def api_workflows() -> list[Path]:
    return sorted(API_WORKFLOW_FOLDER.glob("*.json"))


def load_pack():
    """The repository as package `qi21` (tests/conftest.py normally did this already), through the shared helper
    demo/pack_import.py loaded by its file path (no `sys.path` edit)."""
    spec = importlib.util.spec_from_file_location("qi21_pack_import", REPO / "demo" / "pack_import.py")
    helper = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helper)
    return helper.import_pack(PACKAGE)


def deploy_module(name: str):
    """deploy/<name>.py as a module (deploy/ is a folder of scripts, not a package): the many-workers tests drive its
    start_workers and client, the parallel tests read a prompt's progress through the client's websocket."""
    spec = importlib.util.spec_from_file_location(f"qi21_deploy_{name}", REPO / "deploy" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_checkpoint_writer():
    load_pack()
    if not (REPO / "demo" / "tiny_checkpoints.py").is_file():
        pytest.skip("demo/tiny_checkpoints.py is not there yet: no tiny checkpoints to serve")
    module = importlib.import_module(f"{PACKAGE}.demo.tiny_checkpoints")
    if not hasattr(module, "write_tiny_checkpoints"):
        pytest.skip("demo/tiny_checkpoints.py has no write_tiny_checkpoints(root) yet")
    return module.write_tiny_checkpoints


#: The official templates' int8 ConvRot names (workflows/official_*.json load them), as copies of the tiny bf16 files:
#: the graphs' tests need the names; the int8 format itself is tested in tests/test_quantized.py.
TEMPLATE_ALIASES = {
    "diffusion_models": {"qwen_image_2.1_int8_convrot.safetensors": "qwen_image_2.1_bf16.safetensors",
                         "qwen_image_2.1_turbo_int8_convrot.safetensors": "qwen_image_2.1_turbo_bf16.safetensors"},
    "text_encoders": {"qwen3vl_8b_int8_convrot.safetensors": "qwen3vl_8b_bf16.safetensors"},
}


def write_template_aliases(models: Path) -> None:
    for folder, names in TEMPLATE_ALIASES.items():
        for alias, original in names.items():
            shutil.copyfile(models / folder / original, models / folder / alias)
            tokenizer = models / folder / (Path(original).stem + "_tokenizer")
            if tokenizer.is_dir():  # the text encoder's tokenizer sits beside it under the file's stem
                shutil.copytree(tokenizer, models / folder / (Path(alias).stem + "_tokenizer"), dirs_exist_ok=True)


# -- input images -----------------------------------------------------------------------------------------------
def load_image_names(workflow_files) -> list[str]:
    """File names that LoadImage nodes of these workflows (API or UI form) read from input/."""
    names = []
    for path in workflow_files:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data.get("nodes"), list):  # UI form: the file name is LoadImage's first widget value
            values = [(n.get("widgets_values") or [None])[0] for n in data["nodes"] if n.get("type") == "LoadImage"]
        else:
            values = [n.get("inputs", {}).get("image") for n in data.values()
                      if isinstance(n, dict) and n.get("class_type") == "LoadImage"]
        for value in values:
            if isinstance(value, str):
                names.append(re.sub(r" \[(input|output|temp)\]$", "", value))
    return list(dict.fromkeys(names))


def write_input_image(path: Path, index: int) -> None:
    """A deterministic 320x256 picture; every other one RGBA with a transparent background (a soft disc), so
    LoadImage's MASK -> Reference alpha path runs too."""
    import numpy as np
    from PIL import Image

    width, height = INPUT_IMAGE_SIZE
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    u, v = x / (width - 1), y / (height - 1)
    rgb = np.stack([u, v, 0.5 + 0.5 * np.sin(6.0 * (u + v) + index)], axis=-1)
    pixels = np.clip(np.rint(rgb * 255), 0, 255).astype(np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    if index % 2 == 0:
        Image.fromarray(pixels, "RGB").save(path)
        return
    radius = np.hypot(x - width / 2, y - height / 2) / (0.4 * height)
    alpha = np.clip(np.rint(255 * np.clip(1.5 - radius, 0, 1)), 0, 255).astype(np.uint8)
    Image.fromarray(np.dstack([pixels, alpha]), "RGBA").save(path)


# -- the server -------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def missing_modules(python: str, names) -> list[str]:
    code = ("import importlib.util, json, sys; "
            "print(json.dumps([n for n in sys.argv[1:] if importlib.util.find_spec(n) is None]))")
    out = subprocess.run([python, "-c", code, *names], capture_output=True, text=True, timeout=120, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{python} could not run: {out.stderr.strip()}")
    return json.loads(out.stdout.strip().splitlines()[-1])


class ComfyServer:
    """A running ComfyUI (see the module docstring)."""

    def __init__(self, comfyui: Path, python: str, base: Path):
        self.comfyui, self.python, self.base = comfyui, python, base
        self.pack_name = pack_dir_name()
        self.pack_link = base / "custom_nodes" / self.pack_name
        self.log_path = base / "comfyui.log"
        # errors a test causes on purpose in this server's log (the log check of tests/test_comfyui_server.py skips
        # them): a test that shares the server says here what it asked for, so the check lists no other file's
        self.expected_in_log: list[str] = []
        self.port = None
        self.proc = None
        self.standins: list[str] = []
        self.flushes = 0  # prompts queued by free() to make ComfyUI apply /free's flags

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- set-up
    def write_models(self, models: Path) -> None:
        """The checkpoints the server serves: the tiny random set (a benchmark may serve others)."""
        tiny_checkpoint_writer()(models)

    def prepare(self) -> None:
        for name in ("custom_nodes", "input", "output", "temp", "user/default"):
            (self.base / name).mkdir(parents=True, exist_ok=True)
        self.write_models(self.base / "models")
        write_template_aliases(self.base / "models")
        self.pack_link.symlink_to(REPO, target_is_directory=True)
        for index, name in enumerate(load_image_names(api_workflows() + ui_workflows())):
            write_input_image(self.base / "input" / name, index)
        # a returning user (no template browser or tour on first load); for readable screenshots: no minimap over
        # the canvas and no low-detail rendering of zoomed-out nodes
        settings = {"Comfy.TutorialCompleted": True, "Comfy.Minimap.Visible": False,
                    "LiteGraph.Canvas.MinFontSizeForLOD": 0}
        (self.base / "user" / "default" / "comfy.settings.json").write_text(json.dumps(settings))

    def environment(self) -> dict:
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        missing = missing_modules(self.python, ["torch", "aiohttp", "safetensors", "transformers", "PIL"])
        if missing:
            pytest.fail(f"{self.python} (set {ENV_PYTHON}) lacks {missing}: install ComfyUI's requirements.txt and "
                        "this pack's dependencies into it (see tests/test_comfyui_server.py)")
        self.standins = missing_modules(self.python, ["torchvision", "torchaudio"])
        if self.standins:  # only the stand-ins that are needed: a real package is never shadowed
            path = self.base / "standins"
            path.mkdir(exist_ok=True)
            for name in [*self.standins, "qi21_test_standin.py"]:
                (path / name).symlink_to(STUBS / name)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(path), env.get("PYTHONPATH", "")]))
        return env

    def start(self) -> None:
        self.prepare()
        env = self.environment()
        self.port = free_port()
        command = [self.python, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(self.port),
                   "--base-directory", str(self.base), "--database-url", "sqlite:///:memory:",
                   "--disable-auto-launch", "--disable-api-nodes"]
        self.log_file = open(self.log_path, "w")  # noqa: SIM115  (open as long as the server runs)
        self.proc = subprocess.Popen(command, cwd=self.comfyui, env=env, stdout=self.log_file,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"ComfyUI exited with code {self.proc.returncode} while starting.\n{self.log_tail()}")
            try:
                self.get_json("/system_stats", timeout=5)
                break
            except (OSError, ValueError):
                time.sleep(0.5)
        else:
            raise RuntimeError(f"ComfyUI did not answer within {START_TIMEOUT_S} s.\n{self.log_tail()}")
        if "QI21Sampler" not in self.get_json("/object_info"):
            raise RuntimeError(f"ComfyUI started but lists no QI21 node: the pack did not load.\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=20)
        if getattr(self, "log_file", None) is not None:
            self.log_file.close()

    # -- HTTP
    def request(self, path: str, body=None, timeout: float = 60):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as response:
            return response.read()

    def get_json(self, path: str, timeout: float = 60):
        return json.loads(self.request(path, timeout=timeout))

    def post_json(self, path: str, body, timeout: float = 60):
        try:
            raw = self.request(path, body, timeout=timeout)
        except urllib.error.HTTPError as error:
            raise AssertionError(f"POST {path} -> HTTP {error.code}: {error.read().decode(errors='replace')}") from None
        return json.loads(raw) if raw.strip() else None

    def run_prompt(self, prompt: dict, timeout: float = PROMPT_TIMEOUT_S) -> dict:
        """Queue an API-format prompt and wait for it; its /history entry (outputs, status)."""
        answer = self.post_json("/prompt", {"prompt": prompt, "client_id": "qi21-tests"})
        assert not answer.get("node_errors"), f"the server refused the prompt: {answer}"
        prompt_id = answer["prompt_id"]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            entry = self.get_json(f"/history/{urllib.parse.quote(prompt_id)}").get(prompt_id)
            if entry and entry.get("status", {}).get("status_str") in ("success", "error"):
                return entry
            if self.proc.poll() is not None:
                raise AssertionError(f"ComfyUI died while running the prompt.\n{self.log_tail()}")
            time.sleep(0.25)
        raise AssertionError(f"prompt {prompt_id} did not finish within {timeout} s.\n{self.log_tail()}")

    def free(self, **flags) -> None:
        """POST /free and return once ComfyUI has applied the flags.

        The worker reads the flags after each prompt and when woken up; a wake-up sent while it is still busy with
        its after-prompt housekeeping (garbage collection, which can take seconds on a loaded machine) is lost, and
        then the next queued prompt runs before the flags are applied. With `free_memory` (the node caches are
        dropped anyway) a one-node prompt is queued after the flags and waited for: the flags are read at the end of
        that prompt at the latest, before any later prompt starts. Without it (ComfyUI's "Unload Models", which keeps
        the node outputs that a flushing prompt would drop), pauses before and after are all there is. Callers check
        the effect: the next prompt's `execution_cached` message."""
        time.sleep(1.5)
        self.post_json("/free", flags)
        if not flags.get("free_memory"):
            time.sleep(1.5)
            return
        self.flushes += 1  # another colour each time: the node runs, not from cache
        flush = {"1": {"class_type": "EmptyImage", "inputs": {"width": 8, "height": 8, "batch_size": 1,
                                                              "color": self.flushes}},
                 "2": {"class_type": "PreviewImage", "inputs": {"images": ["1", 0]}}}
        entry = self.run_prompt(flush)
        assert entry["status"]["status_str"] == "success", f"the prompt queued after /free failed: {entry['status']}"

    def view(self, image: dict) -> bytes:
        query = urllib.parse.urlencode({k: image.get(k, "") for k in ("filename", "subfolder", "type")})
        return self.request(f"/view?{query}")

    # -- log
    def log_text(self) -> str:
        if getattr(self, "log_file", None) is not None and not self.log_file.closed:
            self.log_file.flush()
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 60) -> str:
        tail = self.log_text().splitlines()[-lines:]
        return f"--- last {len(tail)} lines of {self.log_path} ---\n" + "\n".join(tail)

    def pack_markers(self) -> list[str]:
        """Strings that show a traceback frame or a log line belongs to this pack."""
        return [f"{os.sep}custom_nodes{os.sep}{self.pack_name}{os.sep}", str(REPO) + os.sep,
                f"custom_nodes.{self.pack_name}"]


def tracebacks(log: str) -> list[str]:
    """Every Python traceback in a log: the line holding 'Traceback (most recent call last):' (alone, or after a
    log prefix) up to its exception line (the first line after it that does not start with white space)."""
    blocks, current = [], None
    for line in re.sub(r"\x1b\[[0-9;]*m", "", log).splitlines():
        if "Traceback (most recent call last):" in line:  # ComfyUI's logger puts "[ERROR] " before it
            if current:
                blocks.append("\n".join(current))
            current = [line]
        elif current is not None:
            current.append(line)
            if line and not line[0].isspace():  # the exception line closes the block
                blocks.append("\n".join(current))
                current = None
    if current:
        blocks.append("\n".join(current))
    return blocks


# -- example workflows, shrunk for a CPU ------------------------------------------------------------------------
def _linked_node(prompt: dict, value):
    if isinstance(value, list) and len(value) == 2 and str(value[0]) in prompt:
        return prompt[str(value[0])]
    return None


def has_references(prompt: dict, sampler: dict) -> bool:
    encoder = _linked_node(prompt, sampler["inputs"].get("positive"))
    return bool(encoder and _linked_node(prompt, encoder["inputs"].get("references")))


def shrink_prompt(prompt: dict) -> tuple[dict, list[str]]:
    """A copy that runs in seconds on a CPU: sampler sides 256 (0 = follow the reference or the latent_image stays
    0 when there is one), at most 3 Base steps, references at resolution <= 288. Returns (copy, what changed)."""
    small, changes = copy.deepcopy(prompt), []
    changes += without_prompt_enhancer(small)

    def cap(node_id, inputs, name, value):
        if name in inputs and inputs[name] != value:
            changes.append(f"{node_id}.{name}: {inputs[name]} -> {value}")
            inputs[name] = value

    for node_id, node in small.items():
        inputs, kind = node.get("inputs", {}), node.get("class_type")
        if kind in SAMPLERS:
            follows = has_references(small, node) or "latent_image" in inputs  # 0 = follow the reference / latent
            for name in ("width", "height"):
                value = inputs.get(name)
                if isinstance(value, int) and not (value == 0 and follows):
                    cap(node_id, inputs, name, SMALL_SIDE)
            if isinstance(inputs.get("steps"), int):
                cap(node_id, inputs, "steps", min(inputs["steps"], SMALL_STEPS))
        elif kind == "QI21Reference" and isinstance(inputs.get("resolution"), int) and inputs["resolution"] != 0:
            cap(node_id, inputs, "resolution", min(inputs["resolution"], SMALL_REFERENCE_RESOLUTION))
    return small, changes


def without_prompt_enhancer(prompt: dict) -> list[str]:
    """Take the prompt-enhancer step out of `prompt` (in place; no PE model can be made here): each TextGenerate
    and what only it reads go, and a switch's `on_true` takes its `on_false` (the switch is off in the examples, so
    the graph runs as it would). Returns what changed."""
    gone = {node_id for node_id, node in prompt.items() if node.get("class_type") == "TextGenerate"}
    if not gone:
        return []
    for node in prompt.values():
        if node.get("class_type") == "ComfySwitchNode" and _linked_id(node["inputs"].get("on_true")) in gone:
            node["inputs"]["on_true"] = node["inputs"]["on_false"]
    while True:  # drop nodes that no longer feed anything but removed ones
        used = {_linked_id(v) for node_id, node in prompt.items() if node_id not in gone
                for v in node.get("inputs", {}).values()}
        orphans = {node_id for node_id in set(prompt) - gone - used
                   if prompt[node_id]["class_type"] in ("CLIPLoader", "PrimitiveStringMultiline", "ImageBatch")}
        if not orphans:
            break
        gone |= orphans
    for node_id in gone:
        del prompt[node_id]
    return [f"prompt enhancer removed: nodes {sorted(gone, key=int)}"]


def _linked_id(value):
    return str(value[0]) if isinstance(value, list) and len(value) == 2 else None


# -- one server per session -------------------------------------------------------------------------------------
_shared: dict = {}


def shared_server() -> ComfyServer:
    """Start the session's server on first use (skips when unconfigured; fails with the log when it won't start)."""
    comfyui, python = configured_comfyui()
    if "error" in _shared:
        pytest.fail(_shared["error"])
    if "server" not in _shared:
        base = Path(tempfile.mkdtemp(prefix="qi21_comfyui_"))
        server = ComfyServer(comfyui, python, base)
        try:
            server.start()
        except RuntimeError as error:
            server.stop()
            _shared["error"] = f"the ComfyUI test server did not start: {error}"
            pytest.fail(_shared["error"])
        except BaseException:
            server.stop()
            shutil.rmtree(base, ignore_errors=True)
            raise
        _shared["server"] = server
    return _shared["server"]


def release_shared_server() -> None:
    server = _shared.pop("server", None)
    if server is not None:
        server.stop()
        if os.environ.get("QI21_KEEP_COMFYUI_BASE"):
            print(f"\nkept the ComfyUI test base directory: {server.base}")
        else:
            shutil.rmtree(server.base, ignore_errors=True)


def server_for(request) -> ComfyServer:
    """The session's server for a `comfyui_server` fixture (session scope) of a test module; stopped when the
    session ends, whichever module asked first."""
    if "server" not in _shared:
        server = shared_server()
        request.config.add_cleanup(release_shared_server)
        return server
    return _shared["server"]
