"""The route key of an API graph: which worker of a farm should run it, so that its kept prefix is found there.

Computed from the graph alone, with the standard library only (no torch, no tokenizer, no model), so a client can
compute it before it uploads anything; this file is copied as it is into clients (and run as
`python nodes/route_key.py graph.json --input-dir DIR`), and the worker route `POST /qi21/route_key`
(nodes/observability.py) runs this same code. Nothing here may import anything outside the standard library
(tests/test_route_key.py checks it).

The key follows the links of each sampler (QI21Sampler, QI21TurboSampler) upstream through our own nodes and keeps
what decides whether a kept prefix can be reused:

- `model`: the DiT file and weight dtype (QI21ModelLoader), each LoRA with its strength in chain order
  (QI21LoraLoader), the Fun ControlNet file, weight dtype and strength (QI21ControlNetApply / Loader);
- `conditioning`: the text encoder file and, per reference in chain order (QI21Reference), its resolution, VAE
  file and the SHA-256 of the bytes of the image file LoadImage reads from the input folder (or the hash a caller
  passes for that file name); without references, the prompt text. With references the words are left out: a new
  instruction after the same references reuses their rows (partial reuse), so it must land on the same worker.

The Step Cache node (QI21StepCache) is looked through: it skips work on the target rows only, never the prefix.
Any other node met on the way (a primitive, an image operation between LoadImage and the reference) is kept whole:
its class and all its inputs, links followed the same way, LoadImage files by content.

The description is a Merkle tree: each node's description (its class and kept inputs) holds a link to another node
as `{"ref": SHA-256 of that node's description}` (with `"output"` for a node outside our own), and is written and
hashed once however many inputs use it. The key is SHA-256 of the canonical JSON of the samplers' references: equal
graphs (up to words, seeds, sizes and the other sampler settings) give equal keys on any machine, and a change to
any node on the way changes every hash downstream of it, hence the key. It is a routing hint, not the exact
`prefix_key` of the report (docs/many-workers.md). `--explain` prints the samplers' references and each hashed
description, upstream first, with the graph's node ids that gave it.

The work is linear in the graph, whatever it holds: each node is described and hashed once (a chain in which each
node uses the one before twice costs one description a node, not 2^depth), and at most `MAX_DESCRIPTION` characters
are hashed for one graph. Chains longer than `MAX_DEPTH` links, cycles, numbers that do not fit a double, node ids,
link indices and strings beyond their bounds are refused by name, and a message quotes at most a short prefix of
any value (docs/troubleshooting.md: the table of bounds).
"""

import argparse
import hashlib
import json
import math
import os
import re
import sys

SAMPLERS = ("QI21Sampler", "QI21TurboSampler")
KEY_LENGTH = 32  # hex digits of the SHA-256 kept in the key (128 bits)
KEY_DOMAIN = b"qi21-route-2\x00"  # 2: node descriptions hashed and referred to by hash (keys before differ)
MAX_NODES = 5000  # far above any real graph; a graph beyond is refused before anything is followed
MAX_DEPTH = 200  # links followed in one chain (a LoRA chain, a reference chain)
MAX_TEXT = 1 << 20  # characters of one string input
MAX_DESCRIPTION = 8 << 20  # characters hashed for one graph, each node once (as much as the route reads of a body)
MAX_ID = 256  # characters of a node id or a class name
MAX_OUTPUT = 1023  # a link's output index (a node has a handful of outputs)
HEX64 = re.compile(r"[0-9a-f]{64}")
ANNOTATION = re.compile(r" \[(input|output|temp)\]$")

#: Our nodes: the inputs that decide a kept prefix (the rest, e.g. a loader's attention or plan, does not).
KEPT_INPUTS = {
    "QI21ModelLoader": ("model_name", "weight_dtype"),
    "QI21LoraLoader": ("model", "lora_name", "strength"),
    "QI21ControlNetApply": ("model", "control_net", "strength"),
    "QI21ControlNetLoader": ("control_net_name", "weight_dtype"),
    "QI21TextEncoderLoader": ("text_encoder_name", "weight_dtype"),
    "QI21VAELoader": ("vae_name", "weight_dtype"),
    "QI21Reference": ("references", "image", "mask", "resolution", "vae"),
    "QI21TextEncode": ("text_encoder", "references", "prompt"),
}
#: Our nodes that leave the kept prefix as their input's: the key is that input's (the Step Cache skips blocks of
#: the target rows only; a graph with and without it finds the same kept prefix).
PASS_THROUGH = {"QI21StepCache": "model"}


class RouteKeyError(ValueError):
    """A graph, a file name or a hash the route key cannot be computed from (the worker route answers 400)."""


class _Graph:
    def __init__(self, graph, input_dir, image_hashes):
        if not isinstance(graph, dict) or not graph:
            raise RouteKeyError(f"the graph must be a non-empty JSON object of API-format nodes (node id -> "
                                f"{{'class_type', 'inputs'}}); got {type(graph).__name__}.")
        if len(graph) > MAX_NODES:
            raise RouteKeyError(f"the graph has {len(graph)} nodes; at most {MAX_NODES} are read.")
        for node_id, node in graph.items():
            if not isinstance(node, dict) or not isinstance(node.get("class_type"), str) or not isinstance(
                    node.get("inputs", {}), dict):
                raise RouteKeyError(f"node {_short(node_id)} is not an API-format node (an object with a string "
                                    "'class_type' and an 'inputs' object).")
            if len(str(node_id)) > MAX_ID or len(node["class_type"]) > MAX_ID:
                raise RouteKeyError(f"node {_short(node_id)}: a node id and its class_type are strings of at most "
                                    f"{MAX_ID} characters.")
        self.nodes = {str(k): v for k, v in graph.items()}
        self.input_dir = input_dir
        self.hashes = _checked_hashes(image_hashes)
        self._files = {}
        self._active = set()
        self._memo = {}  # node id -> (its reference, whether a link to it names the output, chain length below it)
        self.described = {}  # digest -> {"graph nodes": [ids], "description": ...}, upstream first
        self.hashed = 0  # characters of canonical JSON hashed so far (each node once)

    def samplers(self) -> list[str]:
        return sorted((k for k, n in self.nodes.items() if n["class_type"] in SAMPLERS), key=_node_order)

    def link(self, where: str, value):
        """(node id, output) of a link `[id, output]`, or None for a constant."""
        if not isinstance(value, list):
            return None
        if len(value) != 2 or not isinstance(value[0], (str, int)) or isinstance(value[0], bool) or not isinstance(
                value[1], int) or isinstance(value[1], bool) or not 0 <= value[1] <= MAX_OUTPUT or (
                isinstance(value[0], int) and not 0 <= value[0] < 10**MAX_ID):
            raise RouteKeyError(f"{where}: a link must be [node id, output index from 0 to {MAX_OUTPUT}]; got "
                                f"{_short(value)}.")
        if str(value[0]) not in self.nodes:
            raise RouteKeyError(f"{where} links to node {_short(str(value[0]))}, which is not in the graph.")
        return str(value[0]), value[1]

    def value(self, where: str, value, depth: int = 0) -> tuple:
        """(canonical form, the longest chain of links below it) of an input: a constant as it is (numbers as
        floats), a link as a reference to its upstream node's hashed description."""
        linked = self.link(where, value)
        if linked is not None:
            return self.reference(*linked, depth=depth + 1)
        return _constant(where, value), 0

    def reference(self, node_id: str, output: int, depth: int = 0) -> tuple:
        """(reference, chain length) of `output` of `node_id`: `{"ref": the SHA-256 of the node's description}`,
        with `"output"` for a node outside our own (LoadImage's image or mask, a core node's outputs). Each node is
        described and hashed once (memoized), so the work is linear in the graph however many inputs use a node."""
        known = self._memo.get(node_id)
        if known is not None:
            if depth + known[2] > MAX_DEPTH:
                raise RouteKeyError(f"node {_short(node_id)}: more than {MAX_DEPTH} links in one chain.")
        else:
            if depth > MAX_DEPTH:
                raise RouteKeyError(f"node {_short(node_id)}: more than {MAX_DEPTH} links in one chain.")
            if node_id in self._active:
                raise RouteKeyError(f"the graph has a cycle through node {_short(node_id)}.")
            self._active.add(node_id)
            try:
                known = self._referenced(node_id, depth)
            finally:
                self._active.discard(node_id)
            self._memo[node_id] = known
        reference, per_output, height = known
        return ({**reference, "output": output} if per_output else reference), height

    def _referenced(self, node_id: str, depth: int) -> tuple:
        node = self.nodes[node_id]
        kind, inputs = node["class_type"], node.get("inputs", {})
        if kind in PASS_THROUGH:  # the node's reference is its input's, so a graph with it keys as one without
            name = PASS_THROUGH[kind]
            value = inputs.get(name)
            reference, below = self.value(f"node {_short(node_id)} ({kind}) input {name!r}", value, depth)
            return reference, False, below + (1 if isinstance(value, list) else 0)
        if kind == "LoadImage":
            description, height = {"node": kind, "image_sha256": self.image_hash(node_id, inputs.get("image"))}, 0
        else:
            description, height = self._node(node_id, kind, inputs, depth)
        return {"ref": self._hash(node_id, kind, description)}, kind not in KEPT_INPUTS, height

    def _node(self, node_id: str, kind: str, inputs: dict, depth: int) -> tuple:
        """(description, chain length) of one node: the inputs that decide the prefix, links as references."""
        names = KEPT_INPUTS.get(kind, sorted(inputs))
        if kind == "QI21TextEncode" and inputs.get("references") is not None:
            names = tuple(n for n in names if n != "prompt")  # the words do not move a reference prefix
        if kind == "QI21Reference" and inputs.get("fit", "resize") != "resize":
            names = (*names, "fit")  # pad keeps other pixels than resize; left out at its default
        out, height = {"node": kind}, 0
        for name in names:
            if name in inputs:
                where = f"node {_short(node_id)} ({_short(kind)}) input {_short(name)}"
                out[name], below = self.value(where, inputs[name], depth)
                height = max(height, below + (1 if isinstance(inputs[name], list) else 0))
        return out, height

    def _hash(self, node_id: str, kind: str, description: dict) -> str:
        """The SHA-256 of `description`'s canonical JSON, counted against `MAX_DESCRIPTION` (each node once: the
        count is linear in the graph's own size, its links written as 64-digit references)."""
        canonical = _canonical(description)
        self.hashed += len(canonical)
        if self.hashed > MAX_DESCRIPTION:
            raise RouteKeyError(f"node {_short(node_id)} ({_short(kind)}): the graph's description would exceed "
                                f"{MAX_DESCRIPTION} characters (each node's inputs written once, links as hashes); "
                                "at most that much is read.")
        digest = hashlib.sha256(b"qi21-node\x00" + canonical.encode()).hexdigest()
        entry = self.described.setdefault(digest, {"graph nodes": [], "description": description})
        entry["graph nodes"].append(node_id)
        return digest

    def image_hash(self, node_id: str, name) -> str:
        where = f"node {_short(node_id)} (LoadImage) input 'image'"
        if not isinstance(name, str) or not name.strip() or len(name) > 1024:
            raise RouteKeyError(f"{where}: expected a file name in the input folder; got {_short(name)}.")
        annotation = ANNOTATION.search(name)
        if annotation and annotation.group(1) != "input":
            raise RouteKeyError(f"{where}: {_short(name)} names the {annotation.group(1)} folder; the route key reads "
                                "reference images from the input folder only.")
        name = ANNOTATION.sub("", name)
        if name in self.hashes:
            return self.hashes[name]
        if name not in self._files:
            self._files[name] = _file_hash(self.input_dir, name, where)
        return self._files[name]


def _node_order(node_id: str):
    return (0, int(node_id), "") if node_id.isascii() and node_id.isdigit() else (1, 0, node_id)  # not int("²")


def _short(value, limit: int = 60) -> str:
    """`value` as a message quotes it: its repr, cut to about `limit` characters (an API client may send a megabyte
    where a name belongs, and the message must not echo it back, nor spend time writing it out)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 256:
        return f"an integer of about {int(value.bit_length() * 0.30103) + 1} digits"  # repr: slow, refused past 4300
    if isinstance(value, str) and len(value) > limit:
        return repr(value[:limit - 20]) + f"... ({len(value)} characters)"
    if isinstance(value, (list, tuple, dict)):
        text = f"a {type(value).__name__} of {len(value)}" if len(value) > 8 else None
        if text is None:
            try:
                text = repr(value) if sum(len(repr(v)) for v in value) < 4 * limit else None
            except ValueError:  # a huge int inside
                text = None
        text = text or f"a {type(value).__name__} of {len(value)}"
    else:
        text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _canonical(value) -> str:
    """The canonical JSON the hashes are taken over: sorted keys, no spaces, ASCII, no NaN."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def _constant(where: str, value):
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, (int, float)):
        try:
            number = float(value)
        except OverflowError:  # an integer past a double's range (10**400): JSON numbers are doubles to a client
            raise RouteKeyError(f"{where}: {_short(value)} does not fit a double (at most about 1.8e308).") from None
        if not math.isfinite(number):
            raise RouteKeyError(f"{where}: {_short(value)} is not a finite number.")
        return number  # 1 and 1.0 (a JavaScript client sends the former) are the same setting
    if isinstance(value, str):
        if len(value) > MAX_TEXT:
            raise RouteKeyError(f"{where}: a string of {len(value)} characters; at most {MAX_TEXT} are read.")
        return value
    raise RouteKeyError(f"{where}: expected a number, a string, a boolean or a link; got {_short(value)}.")


def _checked_hashes(image_hashes) -> dict:
    if image_hashes is None:
        return {}
    if not isinstance(image_hashes, dict) or len(image_hashes) > MAX_NODES:
        raise RouteKeyError("image_hashes must be an object of file name -> SHA-256 hex digest.")
    out = {}
    for name, digest in image_hashes.items():
        if not isinstance(name, str) or not isinstance(digest, str) or not HEX64.fullmatch(digest.lower()):
            raise RouteKeyError(f"image_hashes[{_short(name)}]: expected the 64 hex digits of the file's SHA-256; "
                                f"got {_short(digest)}.")
        out[ANNOTATION.sub("", name)] = digest.lower()
    return out


def _file_hash(input_dir, name: str, where: str) -> str:
    """SHA-256 of `input_dir/name`, refusing a name that leaves the input folder (absolute, `..`, a link out)."""
    if input_dir is None:
        raise RouteKeyError(f"{where}: {_short(name)} has no hash given (image_hashes) and no input folder to read it "
                            "from.")
    if "\x00" in name or os.path.isabs(name) or name.startswith(("/", "\\")) or ".." in re.split(r"[\\/]", name):
        raise RouteKeyError(f"{where}: {_short(name)} is not a plain file name inside the input folder.")
    root = os.path.realpath(input_dir)
    path = os.path.realpath(os.path.join(root, name))
    if os.path.commonpath([root, path]) != root:
        raise RouteKeyError(f"{where}: {_short(name)} leads outside the input folder.")
    if not os.path.isfile(path):
        raise RouteKeyError(f"{where}: {_short(name)} is not in the input folder ({input_dir}); upload it first or "
                            "pass its hash in image_hashes.")
    hasher = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            hasher.update(block)
    return hasher.hexdigest()


def file_sha256(path) -> str:
    """The hash a client passes in `image_hashes` for a file it holds (the same as the input folder's copy)."""
    return _file_hash(os.path.dirname(os.path.abspath(path)) or ".", os.path.basename(path), str(path))


def route_parts(graph, input_dir=None, image_hashes=None) -> list:
    """What the key hashes: per sampler (node id order; samplers with equal parts once), the references of its
    model chain and its conditioning (`{"ref": SHA-256 of the node's description}`)."""
    return _route(graph, input_dir, image_hashes)[1]


def route_description(graph, input_dir=None, image_hashes=None) -> dict:
    """The key and what it is made of, readable (the command line's --explain, the worker route's answer):
    `samplers` (the parts the key hashes), `nodes` (each hashed description once, upstream first, with the graph's
    node ids that gave it) and `characters_hashed` (the work done: at most the graph's size, never per path)."""
    nodes, parts = _route(graph, input_dir, image_hashes)
    return {"route_key": key_of(parts), "samplers": parts, "nodes": nodes.described,
            "characters_hashed": nodes.hashed}


def _route(graph, input_dir, image_hashes) -> tuple:
    nodes = _Graph(graph, input_dir, image_hashes)
    samplers = nodes.samplers()
    if not samplers:
        raise RouteKeyError(f"the graph has no {' or '.join(SAMPLERS)} node: nothing to route by.")
    parts = []
    for node_id in samplers:
        inputs = nodes.nodes[node_id].get("inputs", {})
        part = {}
        for name in ("model", "positive"):
            where = f"node {_short(node_id)} ({nodes.nodes[node_id]['class_type']}) input {name!r}"
            linked = nodes.link(where, inputs.get(name))
            if linked is None:
                raise RouteKeyError(f"{where}: expected a link to the node that makes it.")
            part[name] = nodes.reference(*linked)[0]
        if part not in parts:  # two samplers of one split schedule share their prefix
            parts.append(part)
    return nodes, parts


def key_of(parts: list) -> str:
    """The key of `route_parts`: SHA-256 of its canonical JSON, `KEY_LENGTH` hex digits."""
    return hashlib.sha256(KEY_DOMAIN + _canonical(parts).encode()).hexdigest()[:KEY_LENGTH]


def route_key(graph, input_dir=None, image_hashes=None) -> str:
    """The graph's route key: `KEY_LENGTH` hex digits (the `X-QI21-Route-Key` header). `input_dir`: the folder
    LoadImage reads from; `image_hashes`: file name -> SHA-256 hex of its bytes, for files the caller holds."""
    return key_of(route_parts(graph, input_dir, image_hashes))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="route-key", description="Print the route key (X-QI21-Route-Key) of a "
                                     "ComfyUI API graph that uses the Qwen-Image 2.1 samplers.")
    parser.add_argument("graph", help="the API-format graph (JSON file; '-' reads standard input)")
    parser.add_argument("--input-dir", help="the folder the graph's LoadImage files are in (default: beside the "
                        "graph)")
    parser.add_argument("--hash", action="append", default=[], metavar="NAME=SHA256",
                        help="the SHA-256 of a LoadImage file instead of reading it (repeatable)")
    parser.add_argument("--explain", action="store_true", help="also print what the key is made of: each sampler's "
                        "references and every node description they lead to, upstream first")
    args = parser.parse_args(argv)
    try:
        text = sys.stdin.read() if args.graph == "-" else open(args.graph, encoding="utf-8").read()  # noqa: SIM115
        graph = json.loads(text)
        if isinstance(graph, dict) and isinstance(graph.get("prompt"), dict):  # a /prompt body
            graph = graph["prompt"]
        bad = [item for item in args.hash if "=" not in item]
        if bad:
            raise RouteKeyError(f"--hash {bad[0]!r}: expected NAME=SHA256.")
        hashes = dict(item.split("=", 1) for item in args.hash)
        input_dir = args.input_dir or (os.path.dirname(os.path.abspath(args.graph)) if args.graph != "-" else None)
        described = route_description(graph, input_dir, hashes)
        if args.explain:
            print(json.dumps({name: described[name] for name in ("samplers", "nodes", "characters_hashed")},
                             indent=2))
    except (OSError, ValueError) as error:  # RouteKeyError and json's errors are ValueErrors
        print(f"route-key: {error}", file=sys.stderr)
        return 2
    print(described["route_key"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
