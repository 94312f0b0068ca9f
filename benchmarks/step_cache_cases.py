"""The trained toy's models folder and the yardstick's cases as bench_step_cache.py reads them (a JSON file with the
edits' reference pictures beside it), so the step cache is measured on the yardstick's prompts.

    python benchmarks/step_cache_cases.py OUT
    python benchmarks/bench_step_cache.py --models OUT/models --prompts OUT/cases.json --steps 40 --settings t8 ...
"""

import json
import sys
from pathlib import Path

import bench_pack  # noqa: F401  (registers the repository as package `qi21`)
import yardstick
from qi21.demo.toy_model import write_toy_checkpoints


def main():
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    write_toy_checkpoints(out / "models")
    cases = {"t2i": [], "edit": []}
    for i, (prompt, source, seed) in enumerate(yardstick.cases()):
        if source is None:
            cases["t2i"].append({"prompt": prompt, "seed": seed})
        else:
            name = f"source_{i}.png"
            source.render().save(out / name)
            cases["edit"].append({"instruction": prompt, "seed": seed, "reference": name})
    (out / "cases.json").write_text(json.dumps(cases, indent=1))
    print(f"{len(cases['t2i'])} prompts, {len(cases['edit'])} edits in {out}")


if __name__ == "__main__":
    main()
