"""One executor for a sampler node's run spec: the same call whether the DiT runs in this process or in worker
processes (the loader's devices). The record's devices feature says which; no node branches on it.

    local   the memory plan (nodes/placement.py) places weights and cache, the run goes to model/sampling/loop.py
            with ComfyUI's interrupt after every block and progress with previews after every step; the report
            gains the plan, the kept store and the quantized GEMMs
    split   the run goes to the workers (model/parallel/split.py) with ComfyUI's interrupt and progress; each rank
            keeps its own shard of the prefix cache, so there is no plan and no kept store here
"""

from dataclasses import replace

from ..model.layers.kitchen import gemm_summary
from ..model.options import options_of
from ..model.sampling.loop import RunServices, RunSpec, run
from ..model.vae.latents import preview_image
from . import bridge, parallel, placement


def execute(model, spec: RunSpec, steps: int) -> tuple[object, dict, list[str]]:
    """Run `spec` on `model` with ComfyUI's progress and interrupt: (the `SampleResult`, report keys the executor
    adds, notes for the log)."""
    record = options_of(model)
    spec = replace(spec, options=record)
    progress = bridge.Progress(steps)
    if record.split:
        if spec.sampler is not None:
            raise ValueError("the sampler input (a ComfyUI SAMPLER) runs in ComfyUI's process and cannot drive a "
                             "model run in worker processes (the loader's devices); disconnect it or leave devices "
                             "empty.")
        fields = {name: getattr(spec, name) for name in RunSpec.__dataclass_fields__
                  if name not in ("positive", "sampler", "options")}
        return parallel.sample_split(model, spec.positive, progress, step_cache=record.step_cache,
                                     cache_dtype=record.cache.dtype, **fields), {}, []
    negative = spec.negative if spec.cfg > 1 else None
    # The memory plan, made before anything else is allocated: a run that fits no placement is refused here with
    # the least memory it needs and what to change (model/memory/planner.py).
    job = placement.plan_sampling(model, spec.positive, negative, spec.width, spec.height,
                                  spec.batch_size, spec.prefix_cache)
    show_previews = bridge.previews_enabled()

    def on_step(info):
        bridge.throw_if_interrupted()
        progress.update(info.step + 1, preview_image(info.denoised) if show_previews else None)

    with job.placed():
        result = run(model, spec, RunServices(store=job.store, new_cache=job.new_cache, callback=on_step,
                                              check_interrupt=bridge.throw_if_interrupted))
    added = job.report()  # plan (weights / cache / decode, predicted peak); peak_bytes on a GPU
    kept, notes = job.store_report(spec.keep_cache)  # what the kept store holds; evictions made for this run
    added.update(kept)
    gemm = gemm_summary(model, bridge.compute_device())
    if gemm:  # per quantized format: its own GEMM kernel, or dequantized per layer before a plain GEMM
        added["quantized_gemm"] = gemm
    return result, added, notes
