"""The host's side of the memory plan: what each phase of a whole pipeline (text encoder, DiT, VAE) holds in host
memory, predicted from the same plans as the device's peaks (planner.py), so a 32 GB host is known to fit before
anything loads.

Where a component is in host memory, phase by phase (a GPU; `unified`, a CPU, is below):

    load         the DiT and the text encoder waiting on their files (deferred, loaders/deferred.py: nothing) or,
                 loaded at once, a full copy each; the VAE as its loader leaves it (a full copy)
    encode       the text encoder's streamed layers (pinned; its resident ones are on the device)
    sample       the text encoder after encoding: offloaded to host memory ("host", what ComfyUI does with its
                 own), on another GPU or never moved ("device"), or back on its file ("file"); the DiT's streamed
                 blocks and a host-side prefix cache (pinned: `Plan.host_bytes`); the VAE waiting
    decode       as sampling, the VAE on the device
    next prompt  the text encoder moves back to the device and the DiT is evicted for it: a deferred DiT goes back
                 to its file unless the host has room to spare for it (`keeps_in_ram`), one loaded at once to host
                 memory, beside the text encoder still there

Every figure is above what the process held before loading (the interpreter, torch, ComfyUI), and counts only what
the pipeline holds: a file's page cache is the kernel's to drop, not anonymous memory (measured with RssAnon,
benchmarks/memory.py host). `staging`: the largest tensor converted on the host while it is read (0 when the file's
dtype is the compute dtype).

On a CPU (`unified`) the device is the host: every weight is in host memory while it runs, and each phase adds its
run's transient (the DiT plan's phases already hold the DiT's weights).
"""

from dataclasses import dataclass

from .planner import LayerPlan, Plan
from .weights import LayeredWeights

#: Host memory left free when an evicted model stays in RAM instead of going back to its file.
HOST_HEADROOM = 4 * 2**30
#: Where the text encoder goes after encoding.
ENCODER_AFTER = ("host", "device", "file")


@dataclass(frozen=True)
class HostPlan:
    """Predicted host bytes per phase and, for each, what holds them (`held[phase][component]`)."""

    held: dict

    @property
    def phases(self) -> dict[str, int]:
        return {phase: sum(parts.values()) for phase, parts in self.held.items()}

    @property
    def peak(self) -> int:
        return max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)

    def describe(self) -> str:
        return ", ".join(f"{phase} {total / 1e9:.2f} GB" for phase, total in self.phases.items())


def plan_host(encoder: LayeredWeights, encoder_plan: LayerPlan, dit: LayeredWeights, dit_plan: Plan, vae_bytes: int,
              *, unified: bool = False, deferred: bool = True, encoder_after: str = "host", staging: int = 0,
              encode_transient: int = 0, decode_transient: int = 0, host: int | None = None) -> HostPlan:
    """The host's bytes per phase of one prompt and the next (see the module docstring).

    `encoder_plan` / `dit_plan`: the device plans (`planner.plan_layers`, `planner.plan_run`); `deferred`: the DiT
    and the text encoder wait on their files until placed (the loaders' `defer`, what the nodes do for a GPU);
    `encoder_after`: one of `ENCODER_AFTER`. On a CPU, `encode_transient` / `decode_transient` are the encoding's
    and the decode's activations. `host`: what the host can give (None: unknown): an evicted deferred model stays
    in RAM when that leaves `HOST_HEADROOM` free (`keeps_in_ram`), else it goes back to its file."""
    if encoder_after not in ENCODER_AFTER:
        raise ValueError(f"encoder_after must be one of {ENCODER_AFTER}, got {encoder_after!r}.")
    if unified:  # everything runs in host memory: the weights while they run, and each phase's activations
        te, vae = encoder.total, vae_bytes
        return HostPlan({
            "encode": {"text encoder": te + encode_transient, "DiT": dit.total, "VAE": vae},
            "sample": {"text encoder": te, "DiT": dit_plan.sampling_peak, "VAE": vae},
            "decode": {"text encoder": te, "DiT": dit.total, "VAE": vae + decode_transient},
        })
    dit_waiting = 0 if deferred else dit.total
    if deferred and host is not None and encoder_after == "host":  # evicted to RAM only with room to spare
        encoder_after = "host" if keeps_in_ram(encoder.total, host - vae_bytes - dit_plan.host_bytes) else "file"
    te_after = encoder.total if encoder_after == "host" else 0
    te_streamed = encoder.streamed_bytes(encoder_plan.streamed)
    evicted = dit.total if not deferred else dit_plan.host_bytes
    if deferred and host is not None:  # the next prompt's eviction keeps the DiT in RAM when there is room
        resident = dit.total - dit.streamed_bytes(dit_plan.streamed)
        if keeps_in_ram(resident, host - te_after - vae_bytes - dit_plan.host_bytes):
            evicted = dit_plan.host_bytes + resident
    return HostPlan({
        "load": {"text encoder": 0 if deferred else encoder.total, "DiT": dit_waiting, "VAE": vae_bytes,
                 "staging": staging},
        "encode": {"text encoder": te_streamed, "DiT": dit_waiting, "VAE": vae_bytes, "staging": staging},
        "sample": {"text encoder": te_after, "DiT": dit_plan.host_bytes, "VAE": vae_bytes, "staging": staging},
        "decode": {"text encoder": te_after, "DiT": dit_plan.host_bytes, "VAE": 0},
        # the text encoder still in host memory while the DiT is evicted for it (when both need the device)
        "next prompt": {"text encoder": te_after, "DiT": evicted, "VAE": vae_bytes},
    })


def keeps_in_ram(nbytes: int, available: int | None) -> bool:
    """Whether an evicted model of `nbytes` stays in host memory (the next placement copies it from RAM, fast) or
    goes back to its file (read again from the page cache or the disk): it stays when the host keeps
    `HOST_HEADROOM` free beside it (`available`: what the host can give without swapping; None: unknown, back to
    the file)."""
    return available is not None and available - nbytes >= HOST_HEADROOM
