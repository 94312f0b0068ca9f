"""The one module that talks to ComfyUI: node API, model folders, devices and memory, progress, interrupt and
previews. Without ComfyUI every service falls back to plain PyTorch behaviour, so the nodes run anywhere
(tests, the headless demo).
"""

import logging
import threading
from contextlib import contextmanager
from pathlib import Path

import torch

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
    """Files of `kind` ("diffusion_models", "text_encoders", "vae") plus diffusers repositories that hold the
    matching component, listed as `diffusers/<folder>`."""
    files = set()
    if HAVE_COMFY:
        files.update(_folder_paths.get_filename_list(kind))
    else:
        for folder in _folders(kind):
            if folder.is_dir():
                files.update(str(p.relative_to(folder)) for p in folder.rglob("*") if p.suffix in MODEL_EXTENSIONS)
    component = MODEL_FOLDERS[kind]
    repos = {f"{DIFFUSERS_PREFIX}{repo.name}" for root in _folders("diffusers") if root.is_dir()
             for repo in root.iterdir() if (repo / component).is_dir()}
    return sorted(files) + sorted(repos)


def model_path(kind: str, name: str) -> Path:
    """Where `name` (as listed by `model_choices`) lives; a clear error naming the folders otherwise."""
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
    places = ", ".join(str(f) for f in _folders(kind) + _folders("diffusers")) or "(no models folder configured)"
    raise FileNotFoundError(f"{name!r} was not found in the {kind} folders ({places}). Refresh the list or copy the file there.")


def comfy_tokenizer_dir() -> Path | None:
    """ComfyUI's bundled Qwen tokenizer (used when a single-file text encoder has none beside it)."""
    if not HAVE_COMFY:
        return None
    # `comfy` is a namespace package in current ComfyUI (no __init__.py, so no __file__): locate it through
    # a plain module inside it.
    folder = Path(_comfy_utils.__file__).resolve().parent / "text_encoders" / "qwen25_tokenizer"
    return folder if folder.is_dir() else None


# -- devices and memory -------------------------------------------------------------------------------------
def compute_device() -> torch.device:
    if HAVE_COMFY:
        return _mm.get_torch_device()
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def offload_device() -> torch.device:
    return _mm.unet_offload_device() if HAVE_COMFY else torch.device("cpu")


def module_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


def free_memory(nbytes: int, device: torch.device) -> None:
    """Ask ComfyUI to unload other models until `nbytes` fit on `device` (nothing to do without ComfyUI)."""
    if HAVE_COMFY and device.type != "cpu":
        _mm.free_memory(nbytes, device)


def empty_cache() -> None:
    if HAVE_COMFY:
        _mm.soft_empty_cache()
    elif torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextmanager
def on_device(module: torch.nn.Module, device: torch.device | None = None, offload_after: bool = False):
    """Run `module` on the compute device (or `device`): room is made first; with `offload_after` it goes back
    to the offload device when done (the text encoder: 16 GiB nobody needs during sampling)."""
    device = torch.device(device) if device is not None else compute_device()
    if device.type != "cpu":
        free_memory(module_bytes(module), device)
    module.to(device)
    try:
        yield device
    finally:
        if offload_after and device != offload_device():
            module.to(offload_device())
            empty_cache()


_warned_unmanaged = False


def load_managed(model: torch.nn.Module, on_unload=None) -> torch.device:
    """Put the DiT on the compute device the way ComfyUI loads its own models, so ComfyUI can evict it when
    another model needs the room and on "Unload Models"; `on_unload(model)` runs when it is evicted (the
    kept prefix caches go with it). Without ComfyUI, or if ComfyUI's model patcher refuses the module,
    the model is simply moved (loudly, once)."""
    global _warned_unmanaged
    if HAVE_COMFY:
        try:
            patcher = getattr(model, "_qi21_patcher", None)
            if patcher is None:
                import comfy.model_patcher
                from comfy.patcher_extension import CallbacksMP

                patcher = comfy.model_patcher.ModelPatcher(model, load_device=compute_device(),
                                                           offload_device=offload_device(), size=module_bytes(model))
                if on_unload is not None:
                    def unloaded(patcher, unpatch_all=True):
                        # ComfyUI also detaches (unpatch_all=False) to re-attach a model that stays loaded
                        if unpatch_all:
                            log.info("qi21: ComfyUI unloaded the DiT; its kept prefix caches go with it")
                            on_unload(model)

                    patcher.add_callback(CallbacksMP.ON_DETACH, unloaded)
                model._qi21_patcher = patcher
            # full load: our layers are plain PyTorch, they cannot stream weights like ComfyUI's own ops
            _mm.load_models_gpu([patcher], force_full_load=True)
            return patcher.load_device
        except Exception as error:  # an API change must not stop sampling: fall back, and say so
            if not _warned_unmanaged:
                log.warning("qi21: ComfyUI's model manager refused the DiT (%s); moving it by hand, so ComfyUI will "
                            "not evict it automatically.", error)
                _warned_unmanaged = True
    device = compute_device()
    if device.type != "cpu":
        free_memory(module_bytes(model), device)
    model.to(device)
    return device


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
        self.last_preview = None

    def update(self, step: int, preview=None) -> None:
        self.last_preview = preview if preview is not None else self.last_preview
        if self.bar is not None:
            self.bar.update_absolute(step, self.total, ("JPEG", preview, 512) if preview is not None else None)
