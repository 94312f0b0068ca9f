"""The route key (nodes/route_key.py): standard library only, equal for graphs whose kept prefix is the same (same
model chain and reference bytes, any words), different otherwise; hostile graphs refused with a clear error, by the
module, its command line and the worker route alike."""

import ast
import copy
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from qi21.nodes import observability
from qi21.nodes.route_key import (
    MAX_DEPTH,
    MAX_NODES,
    RouteKeyError,
    file_sha256,
    main,
    route_description,
    route_key,
    route_parts,
)

ROOT = Path(__file__).resolve().parents[1]
MODULE = ROOT / "nodes" / "route_key.py"
API = ROOT / "workflows" / "api"


def graph(name: str) -> dict:
    return json.loads((API / f"{name}.json").read_text())


def load_image_names(prompt: dict) -> list[str]:
    return sorted({n["inputs"]["image"] for n in prompt.values() if n["class_type"] == "LoadImage"})


@pytest.fixture
def inputs(tmp_path):
    """An input folder holding every file the API workflows load, each with its own bytes."""
    folder = tmp_path / "input"
    folder.mkdir()
    for path in sorted(API.glob("*.json")):
        for name in load_image_names(json.loads(path.read_text())):
            (folder / name).write_bytes(f"pixels of {name}".encode())
    return folder


def nodes_of(prompt: dict, kind: str) -> list[dict]:
    return [n for n in prompt.values() if n["class_type"] == kind]


def expanded(described: dict, value):
    """`value` with each reference replaced by the description it names, recursively (the nested form: fine for a
    shipped graph, 2^depth for a doubling chain)."""
    if isinstance(value, dict) and "ref" in value:
        return expanded(described, described["nodes"][value["ref"]]["description"])
    if isinstance(value, dict):
        return {name: expanded(described, inner) for name, inner in value.items()}
    return value


def test_the_module_imports_only_the_standard_library():
    tree = ast.parse(MODULE.read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"line {node.lineno}: a relative import (the module must stand alone)"
            imported.add(node.module.split(".")[0])
    assert imported and imported <= set(sys.stdlib_module_names), imported - set(sys.stdlib_module_names)
    # and it runs as a script in a bare interpreter (-I: no site packages, no pack on the path)
    code = (f"import runpy, sys; runpy.run_path({str(MODULE)!r}); "
            "assert not {'torch', 'numpy', 'PIL'} & set(sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-I", "-c", code], check=True, timeout=60)


def test_no_module_beside_it_shadows_the_standard_library():
    """Run as a script, route_key.py has nodes/ first on `sys.path`: a nodes/types.py was imported for Python's
    `types` (by argparse, under `python -S`) and failed on its relative import."""
    beside = {path.stem for path in MODULE.parent.glob("*.py")} | {path.name for path in MODULE.parent.iterdir()
                                                                     if (path / "__init__.py").is_file()}
    assert not beside & set(sys.stdlib_module_names), beside & set(sys.stdlib_module_names)
    for command in ([sys.executable, "-S", str(MODULE), "--help"], [sys.executable, "-m", "nodes.route_key", "--help"]):
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and "--explain" in done.stdout, (command, done.stderr[-2000:])


def test_every_shipped_api_workflow_has_a_key(inputs):
    keys = {}
    for path in sorted(API.glob("*.json")):
        prompt = json.loads(path.read_text())
        if nodes_of(prompt, "QI21Sampler") or nodes_of(prompt, "QI21TurboSampler"):
            keys[path.stem] = route_key(prompt, inputs)
    assert len(keys) >= 15 and all(len(k) == 32 for k in keys.values())
    assert len(set(keys.values())) == len(keys)  # different model chains, references or prompts


def test_the_words_do_not_move_a_reference_prefix_but_the_references_do(inputs):
    base = graph("edit_three_references")
    key = route_key(base, inputs)
    other_words = copy.deepcopy(base)
    nodes_of(other_words, "QI21TextEncode")[0]["inputs"]["prompt"] = "Make it snow."
    assert route_key(other_words, inputs) == key
    settings = copy.deepcopy(base)  # what the sampler and the loaders' speed options do not put in the prefix
    sampler = nodes_of(settings, "QI21Sampler")[0]["inputs"]
    sampler.update(seed=7, steps=9, width=512, keep_cache=True)
    nodes_of(settings, "QI21ModelLoader")[0]["inputs"].update(attention="sdpa", plan="stream")
    assert route_key(settings, inputs) == key
    resized = copy.deepcopy(base)  # the Reference's fit at its default is the key of a graph saved before fit
    nodes_of(resized, "QI21Reference")[0]["inputs"]["fit"] = "resize"
    assert route_key(resized, inputs) == key

    changes = {
        "dit file": ("QI21ModelLoader", "model_name", "other.safetensors"),
        "dit dtype": ("QI21ModelLoader", "weight_dtype", "fp16"),
        "reference size": ("QI21Reference", "resolution", 512),
        "reference fit": ("QI21Reference", "fit", "pad"),
        "vae": ("QI21VAELoader", "vae_name", "other_vae.safetensors"),
        "text encoder": ("QI21TextEncoderLoader", "text_encoder_name", "other_te.safetensors"),
    }
    for what, (kind, name, value) in changes.items():
        changed = copy.deepcopy(base)
        nodes_of(changed, kind)[0]["inputs"][name] = value
        assert route_key(changed, inputs) != key, what
    (inputs / "example_2.png").write_bytes(b"other pixels")  # same name, other bytes
    assert route_key(base, inputs) != key
    swapped = copy.deepcopy(base)  # the same images in another order
    swapped["4"]["inputs"]["image"], swapped["6"]["inputs"]["image"] = "example_2.png", "example_1.png"
    assert route_key(swapped, inputs) != route_key(base, inputs)


def test_without_references_the_prompt_is_the_key(inputs):
    base = graph("text_to_image_base")
    other = copy.deepcopy(base)
    nodes_of(other, "QI21TextEncode")[0]["inputs"]["prompt"] += " At night."
    assert route_key(other, inputs) != route_key(base, inputs)
    reseeded = copy.deepcopy(base)
    nodes_of(reseeded, "QI21Sampler")[0]["inputs"]["seed"] = 1
    assert route_key(reseeded, inputs) == route_key(base, inputs)


def test_a_step_cache_node_leaves_the_key_as_it_is(inputs):
    base = graph("text_to_image_base")
    skipping = copy.deepcopy(base)
    sampler = nodes_of(skipping, "QI21Sampler")[0]
    skipping["30"] = {"class_type": "QI21StepCache", "inputs": {"model": sampler["inputs"]["model"], "mode": "t8",
                                                                "threshold": 0.08}}
    sampler["inputs"]["model"] = ["30", 0]
    assert route_key(skipping, inputs) == route_key(base, inputs)
    skipping["30"]["inputs"]["model"] = ["404", 0]
    with pytest.raises(RouteKeyError, match="QI21StepCache"):
        route_key(skipping, inputs)


def test_the_lora_chain_and_the_control_net_are_in_the_key(inputs):
    lora = graph("base_turbo_lora")
    key = route_key(lora, inputs)
    for strength in (0.5, 1):  # 1 (a JavaScript client's 1.0) is the same setting as 1.0
        changed = copy.deepcopy(lora)
        nodes_of(changed, "QI21LoraLoader")[0]["inputs"]["strength"] = strength
        assert (route_key(changed, inputs) == key) is (strength == 1)
    chained = copy.deepcopy(lora)  # a second LoRA after the first, then the two in the other order
    chained["20"] = {"class_type": "QI21LoraLoader", "inputs": {"model": ["4", 0], "lora_name": "b.safetensors",
                                                                   "strength": 0.7}}
    nodes_of(chained, "QI21Sampler")[0]["inputs"]["model"] = ["20", 0]
    reordered = copy.deepcopy(chained)
    reordered["20"]["inputs"]["model"], reordered["4"]["inputs"]["model"] = ["1", 0], ["20", 0]
    nodes_of(reordered, "QI21Sampler")[0]["inputs"]["model"] = ["4", 0]
    assert len({key, route_key(chained, inputs), route_key(reordered, inputs)}) == 3

    control = graph("controlnet_canny")
    key = route_key(control, inputs)
    for name, value, moves in (("strength", 0.6, True), ("end_percent", 0.5, False)):
        changed = copy.deepcopy(control)
        nodes_of(changed, "QI21ControlNetApply")[0]["inputs"][name] = value
        assert (route_key(changed, inputs) != key) is moves, name
    changed = copy.deepcopy(control)
    nodes_of(changed, "QI21ControlNetLoader")[0]["inputs"]["control_net_name"] = "other_union.safetensors"
    assert route_key(changed, inputs) != key
    described = route_description(control, inputs)
    parts = expanded(described, described["samplers"][0]["model"])
    assert parts["control_net"]["control_net_name"].endswith("union_bf16.safetensors") and parts["strength"] == 1.0


def test_caller_hashes_equal_the_files(inputs):
    prompt = graph("official_image_edit")  # two references, the prompt through a switch and a primitive
    hashes = {name: file_sha256(inputs / name) for name in load_image_names(prompt)}
    assert hashes == {name: hashlib.sha256((inputs / name).read_bytes()).hexdigest() for name in hashes}
    assert route_key(prompt, None, hashes) == route_key(prompt, inputs)
    annotated = copy.deepcopy(prompt)
    for node in nodes_of(annotated, "LoadImage"):
        node["inputs"]["image"] += " [input]"
    assert route_key(annotated, inputs) == route_key(prompt, inputs)
    with pytest.raises(RouteKeyError, match="no hash given"):
        route_key(prompt, None, {})


def hostile_graphs():
    ok = graph("edit_one_reference")
    sampler = next(k for k, n in ok.items() if n["class_type"] == "QI21Sampler")
    loader = next(k for k, n in ok.items() if n["class_type"] == "LoadImage")

    def edited(changes):
        out = copy.deepcopy(ok)
        for (node, name), value in changes.items():
            out[node]["inputs"][name] = value
        return out

    def with_image(name):
        return edited({(loader, "image"): name})

    cycle = copy.deepcopy(ok)
    cycle["90"] = {"class_type": "QI21LoraLoader", "inputs": {"model": ["91", 0], "lora_name": "a", "strength": 1}}
    cycle["91"] = {"class_type": "QI21LoraLoader", "inputs": {"model": ["90", 0], "lora_name": "b", "strength": 1}}
    cycle[sampler]["inputs"]["model"] = ["90", 0]
    deep = copy.deepcopy(ok)
    model = deep[sampler]["inputs"]["model"]
    for i in range(MAX_DEPTH + 5):
        deep[f"l{i}"] = {"class_type": "QI21LoraLoader", "inputs": {"model": model, "lora_name": "x", "strength": 1}}
        model = [f"l{i}", 0]
    deep[sampler]["inputs"]["model"] = model
    huge = {str(i): {"class_type": "Note", "inputs": {}} for i in range(MAX_NODES + 1)}
    return {
        "not an object": (["a", "list"], "non-empty JSON object"),
        "empty": ({}, "non-empty JSON object"),
        "huge": (huge, f"at most {MAX_NODES}"),
        "node without class": ({**ok, "x": {"inputs": {}}}, "not an API-format node"),
        "no sampler": ({"1": {"class_type": "LoadImage", "inputs": {"image": "a.png"}}}, "no QI21Sampler"),
        "missing node": (edited({(sampler, "model"): ["999", 0]}), "not in the graph"),
        "bad link": (edited({(sampler, "model"): ["1", 0, 2]}), "a link must be"),
        "negative output": (edited({(sampler, "model"): ["1", -1]}), "a link must be"),
        "model not linked": (edited({(sampler, "model"): "qwen.safetensors"}), "expected a link"),
        "cycle": (cycle, "cycle through node"),
        "deep chain": (deep, f"more than {MAX_DEPTH} links"),
        "nan strength": (edited({("1", "weight_dtype"): float("nan")}), "not a finite number"),
        "object input": (edited({("1", "weight_dtype"): {"a": 1}}), "expected a number"),
        "parent folder": (with_image("../secret.png"), "not a plain file name"),
        "nested parent": (with_image("sub/../../secret.png"), "not a plain file name"),
        "absolute": (with_image("/etc/passwd"), "not a plain file name"),
        "output folder": (with_image("a.png [output]"), "names the output folder"),
        "not a string": (with_image(7), "expected a file name"),
        "missing file": (with_image("nowhere.png"), "not in the input folder"),
        "link out": (with_image("link.png"), "leads outside the input folder"),
    }


@pytest.mark.parametrize("case", sorted(hostile_graphs()))
def test_hostile_graphs_are_refused_clearly(inputs, tmp_path, case):
    (tmp_path / "secret.png").write_bytes(b"not yours")
    (inputs / "link.png").symlink_to(tmp_path / "secret.png")
    prompt, message = hostile_graphs()[case]
    with pytest.raises(RouteKeyError, match=message):
        route_key(prompt, inputs)
    status, answer = observability.route_key_answer(json.dumps({"prompt": prompt}).encode(), input_dir=inputs)
    assert status == 400 and (message in answer["error"] or "expected a JSON object" in answer["error"])


def test_bad_hashes_are_refused(inputs):
    prompt = graph("edit_one_reference")
    for hashes in ({"example.png": "abc"}, ["not", "a", "dict"], {"example.png": 5}):
        with pytest.raises(RouteKeyError, match="image_hashes"):
            route_key(prompt, inputs, hashes)


def test_the_worker_route_and_the_command_line_compute_the_same_key(inputs, tmp_path, capsys):
    prompt = graph("edit_three_references")
    key = route_key(prompt, inputs)
    status, answer = observability.route_key_answer(json.dumps({"prompt": prompt}).encode(), input_dir=inputs)
    assert status == 200 and answer["route_key"] == key and answer["parts"] == route_parts(prompt, inputs)
    hashes = {name: file_sha256(inputs / name) for name in load_image_names(prompt)}
    status, answer = observability.route_key_answer(json.dumps({"prompt": prompt, "image_hashes": hashes}).encode(),
                                                    input_dir=tmp_path / "empty")
    assert status == 200 and answer["route_key"] == key
    for body in (b"{not json", b"[]", json.dumps({"graph": prompt}).encode(), b"\xff\xfe"):
        status, answer = observability.route_key_answer(body, input_dir=inputs)
        assert status == 400 and ("expected a JSON object" in answer["error"] or "not JSON" in answer["error"])

    path = tmp_path / "graph.json"
    path.write_text(json.dumps({"prompt": prompt, "client_id": "x"}))  # a /prompt body is read as well
    assert main([str(path), "--input-dir", str(inputs)]) == 0
    assert capsys.readouterr().out.strip() == key
    given = [f"--hash={name}={digest}" for name, digest in hashes.items()]
    assert main([str(path), "--input-dir", str(tmp_path / "empty"), *given, "--explain"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == key
    assert main([str(path), "--input-dir", str(tmp_path / "empty")]) == 2
    assert "not in the input folder" in capsys.readouterr().err
    assert main([str(path), "--hash", "nonsense"]) == 2
    assert "NAME=SHA256" in capsys.readouterr().err
