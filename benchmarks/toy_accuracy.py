"""Does the toy draw what it is asked? 40 text-to-image prompts and 20 edits drawn from its vocabulary (another
seed than training's draws), 40 Base steps at 256x256, each picture read by demo/toy_eval.py `analyse`.

Prints, per kind, the share whose shape has the asked colour and sits on the asked side (and the share with the
asked background too); an edit must keep what it was not asked to change. `--sheet FILE` writes every picture
with its prompt and what was read (docs/images/toy_accuracy.png).

    python benchmarks/toy_accuracy.py [--steps 40] [--cfg 4] [--turbo] [--sheet FILE] [--toy DIR]
"""

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch
from PIL import Image

import bench_pack  # noqa: F401  (registers the repository as package `qi21`)
from qi21.demo.toy_data import random_edit, random_scene
from qi21.demo.toy_eval import ToyPipeline, analyse
from qi21.demo.toy_model import TOY_DIR, write_toy_checkpoints
from qi21.demo.toy_workflows import contact_sheet


def asked(scene) -> tuple:
    item = scene.items[0]
    return scene.background, item.colour, item.position


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--turbo", action="store_true", help="the Turbo DiT and its 8 stored sigmas")
    parser.add_argument("--cfg", type=float, default=1.0, help="true CFG against the empty prompt (1: none)")
    parser.add_argument("--prompts", type=int, default=40)
    parser.add_argument("--edits", type=int, default=20)
    parser.add_argument("--sheet", type=Path, default=None)
    parser.add_argument("--toy", type=Path, default=TOY_DIR,
                        help="the toy's files (default demo/toy/; a fresh `train_toy.py --out DIR` to judge it)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(11)
    t2i = [random_scene(rng) for _ in range(args.prompts)]
    edits = [random_edit(rng, ("recolour", "move", "background")[i % 3]) for i in range(args.edits)]
    with tempfile.TemporaryDirectory() as tmp:
        write_toy_checkpoints(Path(tmp), args.toy)
        pipe = ToyPipeline(Path(tmp))
        entries, tick = [], time.perf_counter()
        for kind, cases in (("text-to-image", [(s.caption(0), None, s) for s in t2i]),
                            ("edit", [(e.instruction, e.source, e.target) for e in edits])):
            if not cases:  # --prompts 0 or --edits 0
                continue
            sided = full = 0
            for i, (prompt, source, wanted) in enumerate(cases):
                refs = (pipe.reference(source.render()),) if source else ()
                image = pipe.generate(prompt, 100 + i, refs, steps=args.steps, turbo=args.turbo, cfg=args.cfg,
                                      negative="" if args.cfg != 1 else None)[0][0]
                got = analyse(image).reading
                want = asked(wanted)
                sided += got[1:] == want[1:]
                full += got == want
                path = Path(tmp) / f"{kind}_{i}.png"
                Image.fromarray((image * 255).round().byte().numpy(), "RGBA").save(path)
                label = f"{'ok' if got == want else 'MISS'}: {' '.join(str(g) for g in got)}"
                entries.append((label, (f"[{asked(source)[1]} {asked(source)[2]}] " if source else "") + prompt,
                                path))
            print(f"{kind}: {sided}/{len(cases)} ({100 * sided / len(cases):.0f}%) have the asked colour and side, "
                  f"{full}/{len(cases)} also the asked background")
        print(f"{len(entries)} pictures in {time.perf_counter() - tick:.1f} s "
              f"({'Turbo, 8 sigmas' if args.turbo else f'{args.steps} Base steps'}, cfg {args.cfg:g})")
        if args.sheet:
            print(f"sheet: {contact_sheet(entries, args.sheet, columns=10)}")


if __name__ == "__main__":
    main()
