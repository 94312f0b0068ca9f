"""The one module that talks to ComfyUI: node API, model folders, devices and memory, progress, interrupt and
previews. Without ComfyUI every service falls back to plain PyTorch behaviour, so the nodes run anywhere
(tests, the headless demo).
"""

import asyncio
import json
import logging
import threading
from pathlib import Path

import torch

from ..model.loaders.safetensors_io import shown
from ..model.memory.weights import bytes_on

log = logging.getLogger("qi21")

try:  # inside ComfyUI
    import comfy.model_management as _mm
    import comfy.utils as _comfy_utils
    import folder_paths as _folder_paths
    from comfy_api.latest import ComfyExtension, io

    HAVE_COMFY = True
except ImportError:  # plain Python: our stand-in of the V3 API
    from .comfy_standin import ComfyExtension, io

    _mm = _comfy_utils = _folder_paths = None
    HAVE_COMFY = False

__all__ = ["ComfyExtension", "io", "HAVE_COMFY", "log"]

MODEL_FOLDERS = {"diffusion_models": "transformer", "text_encoders": "text_encoder", "vae": "vae"}
DIFFUSERS_PREFIX = "diffusers/"
MODEL_EXTENSIONS = (".safetensors", ".sft", ".ckpt", ".pt", ".pth", ".bin")  # pickles are listed to be refused clearly

# -- model folders ------------------------------------------------------------------------------------------
_plain_models_root: Path | None = None


def set_models_root(path) -> None:
    """Without ComfyUI: the folder holding `diffusion_models/`, `text_encoders/`, `vae/`, `diffusers/`."""
    global _plain_models_root
    _plain_models_root = None if path is None else Path(path)


def _folders(kind: str) -> list[Path]:
    if HAVE_COMFY:
        return [Path(p) for p in _folder_paths.get_folder_paths(kind)]
    if _plain_models_root is None:
        return []
    names = {"diffusion_models": ("diffusion_models", "unet"), "text_encoders": ("text_encoders", "clip")}
    return [_plain_models_root / name for name in names.get(kind, (kind,))]


def model_choices(kind: str) -> list[str]:
    """Files of `kind` ("diffusion_models", "text_encoders", "vae", "loras") plus diffusers repositories that hold
    the matching component, listed as `diffusers/<folder>`."""
    files = set()
    if HAVE_COMFY:
        files.update(_folder_paths.get_filename_list(kind))
    else:
        for folder in _folders(kind):
            if folder.is_dir():
                files.update(str(p.relative_to(folder)) for p in folder.rglob("*") if p.suffix in MODEL_EXTENSIONS)
    component = MODEL_FOLDERS.get(kind)  # None (e.g. "loras"): no diffusers repository holds one
    repos = {f"{DIFFUSERS_PREFIX}{repo.name}" for root in _folders("diffusers") if root.is_dir() and component
             for repo in root.iterdir() if (repo / component).is_dir()}
    return sorted(files) + sorted(repos)


def model_path(kind: str, name: str) -> Path:
    """Where `name` (as listed by `model_choices`) lives; a clear error naming the folders otherwise."""
    try:
        if name.startswith(DIFFUSERS_PREFIX):
            for root in _folders("diffusers"):
                if (root / name[len(DIFFUSERS_PREFIX):]).is_dir():
                    return root / name[len(DIFFUSERS_PREFIX):]
        elif HAVE_COMFY:
            found = _folder_paths.get_full_path(kind, name)
            if found:
                return Path(found)
        else:
            for folder in _folders(kind):
                if (folder / name).is_file():
                    return folder / name
    except (OSError, ValueError):  # a name no file can have (too long, a NUL): not there, said as below
        pass
    places = ", ".join(str(f) for f in _folders(kind) + _folders("diffusers")) or "(no models folder configured)"
    raise FileNotFoundError(f"{shown(name, 60)} was not found in the {kind} folders ({places}). Refresh the list or "
                            "copy the file there.")


def comfy_tokenizer_dir() -> Path | None:
    """ComfyUI's bundled Qwen tokenizer (used when a single-file text encoder has none beside it)."""
    if not HAVE_COMFY:
        return None
    # `comfy` is a namespace package in current ComfyUI (no __init__.py, so no __file__): locate it through
    # a plain module inside it.
    folder = Path(_comfy_utils.__file__).resolve().parent / "text_encoders" / "qwen25_tokenizer"
    return folder if folder.is_dir() else None


# -- user settings (ComfyUI's settings panel) ------------------------------------------------------------------
#: The ceiling of the kept prefix caches, in GiB (web/qi21_settings.js registers it; 0 or unset: no ceiling).
KEPT_CACHE_BUDGET_SETTING = "QI21.KeptCacheBudgetGiB"
SETTINGS_FILE = "comfy.settings.json"  # where ComfyUI's front end saves each user's settings
_plain_user_root: Path | None = None
_settings_seen: dict = {"stamp": None, "values": {}}


def set_user_root(path) -> None:
    """Without ComfyUI: the folder standing for ComfyUI's `user/` (settings of the user `default` live in it)."""
    global _plain_user_root
    _plain_user_root = None if path is None else Path(path)
    _settings_seen.update(stamp=None, values={})


def settings_path() -> Path | None:
    """The settings file of ComfyUI's `default` user (the one user without --multi-user; with it, the server-wide
    settings of this pack are that user's)."""
    root = Path(_folder_paths.get_user_directory()) if HAVE_COMFY else _plain_user_root
    return None if root is None else root / "default" / SETTINGS_FILE


def user_setting(setting_id: str, default=None):
    """One value of the settings file (re-read only when the file changes); `default` when it is absent or the file
    cannot be read (said once per change of the file: a broken settings file must not stop a run)."""
    path = settings_path()
    try:
        stat = None if path is None else path.stat()
    except OSError:
        stat = None
    stamp = None if stat is None else (str(path), stat.st_mtime_ns, stat.st_size)
    if stamp != _settings_seen["stamp"]:
        values = {}
        if stamp is not None:
            try:
                loaded = json.loads(path.read_text(encoding="utf-8"))
                values = loaded if isinstance(loaded, dict) else {}
            except (OSError, ValueError) as error:
                log.warning("qi21: could not read the user settings %s (%s); using the defaults", path, error)
        _settings_seen.update(stamp=stamp, values=values)
    return _settings_seen["values"].get(setting_id, default)


def kept_cache_budget_bytes() -> int | None:
    """The user's ceiling for the kept prefix caches in bytes, or None (no ceiling: what the memory plan leaves
    free beside each run bounds them, as before the setting existed). A value that is not a number >= 0 is
    ignored, loudly."""
    value = user_setting(KEPT_CACHE_BUDGET_SETTING)
    if value is None or value == "":
        return None
    try:
        gib = float("nan") if isinstance(value, bool) else float(value)
    except (TypeError, ValueError):
        gib = float("nan")
    if not gib >= 0 or gib == float("inf"):
        if _settings_seen.get("warned") != _settings_seen["stamp"]:
            _settings_seen["warned"] = _settings_seen["stamp"]
            log.warning("qi21: setting %s = %r is not a number of GiB >= 0; the kept caches have no ceiling",
                        KEPT_CACHE_BUDGET_SETTING, value)
        return None
    return None if gib == 0 else int(min(gib * 2**30, 2**62))  # 1e308 GiB is no ceiling, not an overflow


# -- devices and memory -------------------------------------------------------------------------------------
def compute_device() -> torch.device:
    if HAVE_COMFY:
        return _mm.get_torch_device()
    if torch.cuda.is_available():  # with its index: tensors report "cuda:0", and "cuda" != "cuda:0"
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gpu_count() -> int:
    """The GPUs torch sees in this process (ComfyUI's `--cuda-device` narrows them to one)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def device_choices() -> list[str]:
    """A component's `device` options: "default" (ComfyUI's compute device), "cpu", then each GPU by index
    (cuda:0, cuda:1, ...). A machine without GPUs lists only the first two, as the pack always did."""
    return ["default", "cpu"] + [f"cuda:{index}" for index in range(gpu_count())]


def device_problem(name, what: str = "device") -> str | None:
    """None when `name` is one of `device_choices()` (or None: a linked input, checked at run time); else a message
    naming `what` and the devices this machine has (a workflow saved on another machine may name a GPU that is not
    here)."""
    if name is None:
        return None
    choices = device_choices()
    if name in choices:
        return None
    listed = f"expected one of {', '.join(choices)}"
    kind, _, index = str(name).partition(":")
    if kind == "cuda" and index.isascii() and index.isdigit() and len(index) < 5:
        count = gpu_count()
        seen = f"{count} GPU{'s' if count != 1 else ''}" if count else "no GPU"
        return (f"{what} = {name!r}: this machine has no GPU {name} (torch sees {seen}); {listed}. The workflow was "
                "probably saved on a machine with more GPUs.")
    return f"{what} = {shown(name, 60) if isinstance(name, str) else repr(name)[:60]}: {listed}."


def chosen_device(name, what: str = "device") -> torch.device | None:
    """The device a `device` input names: None for "default" (the caller uses `compute_device()`), else that
    device; a ValueError (`device_problem`'s message) for one that this machine does not have."""
    problem = device_problem(name, what)
    if problem is not None:
        raise ValueError(problem)
    return None if name in (None, "default") else torch.device(name)


def offload_device() -> torch.device:
    return _mm.unet_offload_device() if HAVE_COMFY else torch.device("cpu")


def free_memory(nbytes: int, device: torch.device) -> None:
    """Ask ComfyUI to unload other models until `nbytes` fit on `device` (nothing to do without ComfyUI)."""
    if HAVE_COMFY and device.type != "cpu":
        _mm.free_memory(nbytes, device)


def memory_limit(device: torch.device) -> int | None:
    """The most memory a run could get on `device`, or None if unknown: a GPU's total memory (ComfyUI can evict
    every other model first, so only what could never fit is refused), or the RAM the kernel can still hand out
    without swapping (Linux `MemAvailable`) on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    if device.type == "cpu":
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None


def empty_cache() -> None:
    if HAVE_COMFY:
        _mm.soft_empty_cache()
    elif torch.cuda.is_available():
        torch.cuda.empty_cache()


def vram_mode() -> str:
    """ComfyUI's VRAM mode as the planner names it: "low" (--lowvram), "no" (--novram), "high" (--highvram,
    --gpu-only) or "normal" (also without ComfyUI)."""
    if not HAVE_COMFY:
        return "normal"
    name = getattr(getattr(_mm, "vram_state", None), "name", "")
    return {"LOW_VRAM": "low", "NO_VRAM": "no", "HIGH_VRAM": "high"}.get(name, "normal")


def memory_figures(device, modules=(), tensors=()) -> dict:
    """What a run may use on `device`, as plain numbers (the keyword arguments of the planner's `Budget`, which
    nodes/placement.py builds from them).

    On a GPU: what is free, plus what ComfyUI would evict for the run (every model it holds on that device, ours
    included), minus its reserve (`--reserve-vram`); without ComfyUI, `torch.cuda.mem_get_info`'s free memory plus
    what torch's allocator holds unused, plus what `modules` (our own models, moved by hand) already hold there.
    `tensors` already on the device that the run may reclaim (kept prefix caches) count in both cases. `held`:
    what `modules` hold there now. The host figure is the RAM available without swapping plus what `modules`
    already hold in RAM (streamed weights are pinned in place of those copies). On a CPU the device is the host:
    the RAM available without swapping (`memory_limit`) plus what `modules` and `tensors` already hold."""
    device = torch.device(device)
    cpu = torch.device("cpu")
    module_tensors = [t for m in modules for t in (*m.parameters(), *m.buffers())]
    available = memory_limit(cpu)
    host_held = bytes_on(module_tensors, cpu)
    if device.type == "cpu":
        held = host_held + bytes_on(tensors, cpu)
        return dict(device=(available if available is not None else 1 << 62) + held, host=None, unified=True,
                    where="cpu", held=held)
    held = bytes_on(module_tensors, device)
    reclaim = bytes_on(tensors, device)
    host = None if available is None else available + host_held
    if HAVE_COMFY:
        free = _mm.get_free_memory(device)
        evictable = sum(loaded.model_loaded_memory() for loaded in list(_mm.current_loaded_models)
                        if loaded.device == device and loaded.model is not None)
        reserve = int(_mm.extra_reserved_memory())
        return dict(device=int(free + evictable - reserve + reclaim), host=host, where=str(device),
                    mode=vram_mode(), reserve=reserve, held=held)
    free, _ = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return dict(device=int(free + held + reclaim), host=host, where=str(device), held=held)


_warned_unmanaged = False


def _forget(patcher) -> None:
    """Take a patcher we no longer use (its model now streams other layers) out of ComfyUI's loaded list."""
    for index, loaded in enumerate(list(_mm.current_loaded_models)):
        if loaded.model is patcher:
            loaded.model_unload()
            _mm.current_loaded_models.pop(index)
            return


def _patcher(model: torch.nn.Module, resident, streamed: tuple, on_unload, what: str, device: torch.device):
    """ComfyUI's ModelPatcher over the resident part of `model` (`resident()`; all of it when nothing is streamed)
    that loads it on `device`, kept in the model's `manager` field and remade when the streamed set or the device
    changes."""
    import comfy.model_patcher
    from comfy.patcher_extension import CallbacksMP

    patcher = getattr(model, "manager", None)
    if patcher is not None and getattr(patcher, "qi21_streamed", ()) == streamed and patcher.load_device == device:
        return patcher
    if patcher is not None:
        patcher.qi21_replaced = True  # its detach below is a plan change, not ComfyUI unloading the model
        _forget(patcher)
    # always a container of the resident subtrees (the whole model when nothing is streamed): ComfyUI sets attributes
    # such as `device` on what it loads, which a transformers model (the text encoder) has as a read-only property
    part = resident()
    size = sum(t.numel() * t.element_size() for t in part.state_dict().values())
    patcher = comfy.model_patcher.ModelPatcher(part, load_device=device, offload_device=offload_device(), size=size)
    patcher.qi21_streamed = streamed
    if on_unload is not None:
        def unloaded(patcher, unpatch_all=True):
            # ComfyUI also detaches (unpatch_all=False) to re-attach a model that stays loaded
            if unpatch_all and not getattr(patcher, "qi21_replaced", False):
                log.info("qi21: ComfyUI unloaded the %s; what it kept goes with it", what)
                on_unload(model)

        patcher.add_callback(CallbacksMP.ON_DETACH, unloaded)
    # The patcher lives in the model's `manager` field, not in a registry here: ComfyUI holds patchers only weakly,
    # and a patcher holds its model strongly, so a bridge-side dict (even a WeakKeyDictionary keyed by the model)
    # would keep every model ever loaded alive. As a model <-> patcher cycle both go when the graph drops the
    # model, and ComfyUI's weak references then see them gone and release the VRAM.
    model.manager = patcher
    return patcher


def load_managed(model: torch.nn.Module, resident, streamed: tuple = (), on_unload=None, *,
                 memory_required: int = 0, what: str = "DiT", device=None) -> torch.device | None:
    """Have ComfyUI load the resident part of `model` (`resident()`, a module) the way it loads its own models, so
    it can evict it when another model needs the room and on "Unload Models", and frees other models for it (and
    for `memory_required` bytes beside it: the run's activations, cache and streaming slots). `device`: the GPU to
    load it on (default: ComfyUI's compute device; another GPU is how ComfyUI-MultiGPU places a component, and
    ComfyUI then makes room on that GPU only). `streamed` (the layers that stay with the streamer) keys the
    patcher: a new set makes a new one. `on_unload(model)` runs when ComfyUI evicts it. Returns ComfyUI's load
    device, or None without ComfyUI or when its model patcher refuses the module (said loudly, once): then the
    caller places the model itself."""
    global _warned_unmanaged
    if not HAVE_COMFY:
        return None
    try:
        device = torch.device(device) if device is not None else compute_device()
        patcher = _patcher(model, resident, tuple(streamed), on_unload, what, device)
        # full load of the resident part: our layers are plain PyTorch, they cannot stream weights through
        # ComfyUI's own ops; what does not fit was planned as streamed instead
        _mm.load_models_gpu([patcher], memory_required=memory_required, force_full_load=True)
        return patcher.load_device
    except (MemoryError, torch.cuda.OutOfMemoryError, KeyboardInterrupt):
        raise
    except Exception as error:  # an API change must not stop sampling: fall back, and say so
        if type(error).__name__ == "InterruptProcessingException":  # ComfyUI's Cancel is not a refusal
            raise
        if not _warned_unmanaged:
            log.warning("qi21: ComfyUI's model manager refused the %s (%s); moving it by hand, so ComfyUI will "
                        "not evict it automatically.", what, error)
            _warned_unmanaged = True
    return None


# -- progress, interrupt, previews --------------------------------------------------------------------------
_interrupt = threading.Event()


def request_interrupt() -> None:
    """Without ComfyUI: make the running sampler stop after its current step (what Cancel does in ComfyUI)."""
    _interrupt.set()


def throw_if_interrupted() -> None:
    if HAVE_COMFY:
        _mm.throw_exception_if_processing_interrupted()
    elif _interrupt.is_set():
        _interrupt.clear()
        raise InterruptedError("sampling was interrupted")


def previews_enabled() -> bool:
    """False when ComfyUI's preview method is "none" (then no preview is computed at all)."""
    if not HAVE_COMFY:
        return True
    try:
        from comfy.cli_args import LatentPreviewMethod, args
    except ImportError:
        return True
    return args.preview_method != LatentPreviewMethod.NoPreviews


class Progress:
    """Per-step progress with an optional preview image (PIL), shown on the node by ComfyUI."""

    def __init__(self, total: int):
        self.total = total
        self.bar = _comfy_utils.ProgressBar(total) if HAVE_COMFY else None

    def update(self, step: int, preview=None) -> None:
        if self.bar is not None:
            self.bar.update_absolute(step, self.total, ("JPEG", preview, 512) if preview is not None else None)


# -- samplers -----------------------------------------------------------------------------------------------
def flow_model_sampling(base_class, *args):
    """`base_class(*args)` (model/sampling/denoiser.py's FlowModelSampling), with ComfyUI's CONST mixed in when
    ComfyUI is there: its samplers test `isinstance(model_sampling, comfy.model_sampling.CONST)` to pick their
    flow-matching branches (the RF forms of the ancestral samplers, the half-log-SNR of the SDE ones)."""
    if not HAVE_COMFY:
        return base_class(*args)
    import comfy.model_sampling

    mixed = type(f"QI21{base_class.__name__}", (base_class, comfy.model_sampling.CONST), {})
    return mixed(*args)


def sampler_object(name: str = "euler"):
    """The SAMPLER that ComfyUI's KSamplerSelect gives for `name`; without ComfyUI the stand-in's Euler (the only
    one it has), so the samplers' `sampler` path runs in tests and the demo."""
    if HAVE_COMFY:
        import comfy.samplers

        return comfy.samplers.sampler_object(name)
    if name != "euler":
        raise ValueError(f"sampler {shown(name, 60)} needs ComfyUI; without it only the stand-in 'euler' exists.")
    from .comfy_standin import EulerSampler

    return EulerSampler()


# -- server routes ----------------------------------------------------------------------------------------------
def input_directory() -> Path | None:
    """ComfyUI's input folder (where LoadImage reads and /upload/image writes); None without ComfyUI."""
    return Path(_folder_paths.get_input_directory()) if HAVE_COMFY else None


_routes_added: set[tuple[str, str]] = set()


async def read_capped(read, max_body: int, chunk: int = 1 << 16) -> bytes | None:
    """The whole body from `read(n)` (aiohttp's `request.content.read`, which returns what has arrived, up to n
    bytes: one call may hold only the first part of a body), or None once it passes `max_body` bytes (the rest is
    never read)."""
    body = bytearray()
    while True:
        part = await read(chunk)
        if not part:
            return bytes(body)
        body += part
        if len(body) > max_body:
            return None


def add_route(method: str, path: str, handler, max_body: int = 0) -> bool:
    """Serve `handler(body: bytes | None) -> (status, payload)` at `method path` on ComfyUI's own server (and under
    /api, as ComfyUI mirrors every route). `payload`: a dict or list (sent as JSON) or `(text, content type)`.
    The handler runs in a worker thread, so a scrape never waits for the event loop and the loop never waits for
    the handler; a POST body above `max_body` bytes is refused with 413 before it is read. Only serving: the pack
    opens no connection. Returns False without ComfyUI's server (tests, the headless demo): nothing to serve on."""
    if not HAVE_COMFY or (method, path) in _routes_added:
        return False
    try:
        from aiohttp import web  # ComfyUI's HTTP server; its response classes
        from server import PromptServer
    except ImportError:
        return False
    server = getattr(PromptServer, "instance", None)
    if server is None:
        return False

    async def serve(request):
        body = None
        if method == "POST":
            if request.content_length is not None and request.content_length > max_body:
                return web.json_response({"error": f"the body is {request.content_length} bytes; at most "
                                                   f"{max_body} are read."}, status=413)
            body = await read_capped(request.content.read, max_body)
            if body is None:
                return web.json_response({"error": f"the body is over {max_body} bytes."}, status=413)
        loop = asyncio.get_running_loop()
        status, payload = await loop.run_in_executor(None, handler, body)
        if isinstance(payload, tuple):
            text, content_type = payload
            return web.Response(body=text.encode(), status=status, headers={"Content-Type": content_type})
        return web.json_response(payload, status=status)

    server.routes.route(method, path)(serve)
    _routes_added.add((method, path))
    return True
