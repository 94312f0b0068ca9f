"""Weights that wait on their file until the memory plan says where they run.

A loaded model used to wait for the GPU as a full copy in anonymous host memory: every loader copies each tensor out
of the file's mapping into memory of its own, deliberately (a model living on a mapping dies with SIGBUS when the
file is truncated or changes silently when it is replaced). A 14.2 GB DiT loaded beside a 16.3 GB text encoder
offloaded to RAM then holds about 30 GB of anonymous memory before it runs, and a 32 GB host is killed.

Here a deferred loader (`load_dit(..., defer=True)`) checks the file completely, as before, but leaves each
parameter as a placeholder: the Parameter object the model will keep (LoRA and option copies share it), of the right
shape and dtype, over one element of memory (a stride-0 view). `FileWeights.materialize(device_of)` then reads each
tensor from the file straight to where the plan places it (a GPU for a resident block, pinned host memory for a
streamed one), one tensor at a time, and swaps it into the Parameter (`param.data`). The only host memory that
takes is one tensor's conversion when the file's dtype differs from the compute dtype.

The SIGBUS guarantee stays: a materialized tensor is always memory of its own, never a view of the mapping, and
before reading, every file is checked against what was loaded (size, modification time, the digest of its ends:
`fingerprint.py`; and its header again, which names a truncation). A file changed or truncated on disk after loading
ends in a CheckpointError naming it, not in SIGBUS or in other weights.

`release()` puts every parameter back on the file (an offload that costs no host memory: the next run reads it
again, from the page cache when the host has room for it).
"""

import torch

from .checkpoint import CheckpointError, TensorInfo, WeightReader
from .fingerprint import file_fingerprint
from .safetensors_io import read_header


def placeholder(shape, dtype: torch.dtype) -> torch.Tensor:
    """A host tensor of `shape` and `dtype` over a single element (every stride 0): what a Parameter holds while its
    weights wait on the file. `param.data` may later be swapped for a real tensor on any device."""
    return torch.zeros(1, dtype=dtype).expand(shape) if len(shape) else torch.zeros((), dtype=dtype)


def held_bytes(tensor: torch.Tensor) -> int:
    """Bytes `tensor` really holds: its elements, or less for a placeholder (a stride-0 view over one element)."""
    return min(tensor.numel() * tensor.element_size(), tensor.untyped_storage().nbytes())


class FileWeights:
    """The parameters of one model that are read from its files when placed (`materialize`), and how to read each.

    `entries`: `(parameter, fill)` with `fill(target, reader)` writing the parameter's values into `target` (an empty
    tensor of its shape and dtype, on its device) from a `WeightReader` over `infos`."""

    def __init__(self, infos: dict[str, TensorInfo], entries, what: str):
        self.infos = infos
        self.entries = list(entries)
        self.what = what
        self.files = sorted({info.file for info in infos.values()})
        self.prints = {file: file_fingerprint(file) for file in self.files}
        self.on_file = {id(param) for param, _ in self.entries}  # the parameters that hold a placeholder

    @property
    def waiting(self) -> int:
        """Bytes of parameters still on the file."""
        return sum(p.numel() * p.element_size() for p, _ in self.entries if id(p) in self.on_file)

    def check_files(self) -> None:
        """Every file is the one loaded: else a CheckpointError naming it (a truncation by its header check)."""
        for file in self.files:
            try:
                now = file_fingerprint(file)
            except OSError as error:
                raise CheckpointError(f"{file}: the {self.what}'s weights wait on this file to be read, but it "
                                      f"cannot be read now ({error.strerror or error}). Put it back and load the "
                                      "model again.") from None
            if now != self.prints[file]:
                read_header(file)  # a truncated or damaged file is named as such
                raise CheckpointError(f"{file.name} changed on disk after the {self.what} was loaded, before its "
                                      "weights were read; load the model again (refresh the loader node).")

    def materialize(self, device_of, pin: bool = False, only=None, allocate=None) -> int:
        """Read every waiting parameter (of those whose ids are in `only`, if given) straight to
        `device_of(parameter)` (pinned when that is the host and `pin`); returns the bytes read. A parameter already
        placed is left alone. `allocate(shape, dtype, device)`: where a target comes from (the benchmark's simulated
        device; default `torch.empty`)."""
        waiting = [(param, fill) for param, fill in self.entries
                   if id(param) in self.on_file and (only is None or id(param) in only)]
        if not waiting:
            return 0
        self.check_files()
        total = 0
        with WeightReader(self.infos) as reader:
            for param, fill in waiting:
                device = torch.device(device_of(param))
                pinned = pin and device.type == "cpu"
                target = (allocate(param.shape, param.dtype, device) if allocate is not None
                          else torch.empty(param.shape, dtype=param.dtype, device=device, pin_memory=pinned))
                fill(target, reader)
                param.data = target
                self.on_file.discard(id(param))
                total += target.numel() * target.element_size()
        return total

    def release(self, params=None) -> int:
        """Put parameters back on the file (all, or those of `params`), freeing their memory; returns the bytes."""
        chosen = None if params is None else {id(p) for p in params}
        total = 0
        for param, _ in self.entries:
            if (chosen is None or id(param) in chosen) and id(param) not in self.on_file:
                total += param.numel() * param.element_size()
                param.data = placeholder(param.shape, param.dtype)
                self.on_file.add(id(param))
        return total


def file_weights(model) -> FileWeights | None:
    return getattr(model, "file_weights", None)


def materialize_on_input(weights: FileWeights):
    """A forward pre-hook for a deferred model run without a plan (the Python API): its waiting weights are read
    onto the device of the call's first tensor input (the host without one)."""

    def hook(module, args, kwargs):
        if weights.on_file:  # a set's truth per call; `waiting` would sum every parameter's bytes
            first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
            device = first.device if first is not None else torch.device("cpu")
            weights.materialize(lambda param: device)

    return hook


class FileBackedPart(torch.nn.ModuleList):
    """The modules a host's memory manager (ComfyUI) loads and unloads for a deferred model: moved to the host, its
    file-backed parameters go back to their file instead of into host memory (nothing to hold: the next placement
    reads them again) unless `keep(bytes)` says the host has room for them (then they move as usual, and the next
    placement is a copy from RAM); moved to a device, any still waiting are read straight there."""

    def __init__(self, modules, weights: FileWeights, keep=None):
        super().__init__(modules)
        object.__setattr__(self, "_file_weights", weights)  # not a submodule, not in the state dict
        object.__setattr__(self, "_keep", keep)

    def placed_device(self) -> torch.device:
        """Where its parameters are (the host while they wait on the file)."""
        return next((p.device for p in self.parameters()), torch.device("cpu"))

    def to(self, *args, **kwargs):
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        if device is not None:
            device = torch.device(device)
            if device.type == "cpu":
                held = sum(p.numel() * p.element_size() for p in self.parameters() if p.device.type != "cpu")
                if self._keep is None or not self._keep(held):
                    self._file_weights.release(self.parameters())
            else:
                mine = {id(p) for p in self.parameters()}
                self._file_weights.materialize(lambda param: device, only=mine)
        return super().to(*args, **kwargs)
