"""The route key's work is bounded by the graph (issue 58, item 1; issue 64, item 5): each node is described and
hashed once however many inputs use it, links written as the hash of the upstream description (a Merkle tree), so a
chain whose nodes each use the one before twice costs one description a node; numbers that do not fit a double are
refused by name with HTTP 400, and no message echoes an oversized value.

Found as a hostile API client: 40 chained ImageBlend nodes, each blending the one before with itself, never got an
answer (the key was computed once per path: depths 10 / 12 / 14 / 16 took 0.01 / 0.03 / 0.13 / 0.56 s), and
`weight_dtype` = 10^400 gave an HTTP 500 (OverflowError). Then the nested description (each node walked once, but
written out once per path) refused that chain from 16 links on (2^16 copies of the image's hash over 8 MiB)."""

import json
import time

import pytest

from qi21.nodes import observability, route_key as rk
from qi21.nodes.route_key import (
    MAX_DESCRIPTION,
    MAX_ID,
    MAX_OUTPUT,
    RouteKeyError,
    route_description,
    route_key,
    route_parts,
)

HASHES = {"a.png": "0" * 64}


def blend_chain(links: int, twice: bool = True) -> dict:
    """A reference made of `links` ImageBlend nodes, each blending the one before with itself (`twice`) or with the
    loaded image."""
    graph = {"0": {"class_type": "LoadImage", "inputs": {"image": "a.png"}}}
    for i in range(1, links + 1):
        other = str(i - 1) if twice else "0"
        graph[str(i)] = {"class_type": "ImageBlend", "inputs": {"image1": [str(i - 1), 0], "image2": [other, 0],
                                                                "blend_factor": 0.5, "blend_mode": "normal"}}
    graph.update({
        "ref": {"class_type": "QI21Reference", "inputs": {"image": [str(links), 0], "vae": ["vae", 0],
                                                           "resolution": 1024}},
        "vae": {"class_type": "QI21VAELoader", "inputs": {"vae_name": "vae.safetensors", "weight_dtype": "default"}},
        "te": {"class_type": "QI21TextEncoderLoader", "inputs": {"text_encoder_name": "te.safetensors",
                                                                  "weight_dtype": "default"}},
        "enc": {"class_type": "QI21TextEncode", "inputs": {"text_encoder": ["te", 0], "references": ["ref", 0],
                                                            "prompt": "a cat"}},
        "dit": {"class_type": "QI21ModelLoader", "inputs": {"model_name": "dit.safetensors", "weight_dtype": "bf16"}},
        "sampler": {"class_type": "QI21Sampler", "inputs": {"model": ["dit", 0], "positive": ["enc", 0], "seed": 1}},
    })
    return graph


def answer(graph) -> tuple[int, dict]:
    return observability.route_key_answer(json.dumps({"prompt": graph, "image_hashes": HASHES}).encode())


def count_nodes_walked(monkeypatch) -> list:
    walked = []
    original = rk._Graph._node

    def counting(self, node_id, *args):
        walked.append(node_id)
        return original(self, node_id, *args)

    monkeypatch.setattr(rk._Graph, "_node", counting)
    return walked


def test_a_node_used_by_several_inputs_is_walked_once(monkeypatch):
    walked = count_nodes_walked(monkeypatch)
    described = route_description(blend_chain(10), image_hashes=HASHES)
    assert sorted(walked) == sorted(set(walked)) and len(walked) == 10 + 5  # the blends, ref, vae, te, enc, dit
    # Each description once, the image's hash in LoadImage's alone (the nested one held 2^10 copies of it).
    assert len(described["nodes"]) == 1 + 10 + 5
    assert json.dumps(described["nodes"]).count("0" * 64) == 1
    assert route_parts(blend_chain(10), image_hashes=HASHES) == described["samplers"]


def hashed(graph) -> int:
    return route_description(graph, image_hashes=HASHES)["characters_hashed"]


@pytest.mark.parametrize("links", [16, 60, rk.MAX_DEPTH - 3])  # 197 blends + the reference and the encode: 200
def test_a_doubling_chain_of_core_nodes_gets_its_key_with_work_linear_in_its_length(links):
    """16 links was refused (`would exceed 8388608 characters`); now each link adds the same one description."""
    status, answered = answer(blend_chain(links))
    assert status == 200 and answered["route_key"] == route_key(blend_chain(links), image_hashes=HASHES)
    per_link = hashed(blend_chain(2)) - hashed(blend_chain(1))
    assert 0 < per_link < 300  # one ImageBlend: two 64-digit references, a factor, a mode
    assert hashed(blend_chain(links)) == hashed(blend_chain(1)) + (links - 1) * per_link
    assert len(answered["nodes"]) == 1 + links + 5


def test_equal_graphs_give_equal_keys_and_a_change_deep_down_changes_it():
    base = route_key(blend_chain(60), image_hashes=HASHES)
    renamed = {f"n{node_id}": node for node_id, node in reversed(blend_chain(60).items())}  # other ids, other order
    for node in renamed.values():
        node["inputs"] = {name: ([f"n{value[0]}", value[1]] if isinstance(value, list) else value)
                          for name, value in node["inputs"].items()}
    assert route_key(renamed, image_hashes=HASHES) == base
    reworded = blend_chain(60)
    reworded["enc"]["inputs"]["prompt"] = "a dog"  # with references the words stay out of the key
    assert route_key(reworded, image_hashes=HASHES) == base
    for name, value in (("blend_factor", 0.25), ("blend_mode", "multiply"), ("image2", ["0", 1])):
        deep = blend_chain(60)
        deep["1"]["inputs"][name] = value  # the first blend, 60 links below the reference (image2: the mask)
        assert route_key(deep, image_hashes=HASHES) != base, name
    assert route_key(blend_chain(60), image_hashes={"a.png": "1" * 64}) != base  # other bytes of the image


def test_the_server_answers_a_doubling_chain_at_once_and_then_the_next_graph():
    start = time.monotonic()
    status, answered = answer(blend_chain(40))
    assert time.monotonic() - start < 2.0  # was: never (2^40 walks), then a 400 (2^40 characters to write out)
    assert status == 200 and answered["route_key"] == route_key(blend_chain(40), image_hashes=HASHES)
    status, clean = answer(blend_chain(3))
    assert status == 200 and clean["route_key"] == route_key(blend_chain(3), image_hashes=HASHES)


def test_what_is_hashed_is_bounded_and_refused_by_name():
    graph = blend_chain(9)
    for i in range(1, 10):  # nine modes of a MiB each: each node hashed once, 9 MiB together
        graph[str(i)]["inputs"]["blend_mode"] = str(i) * rk.MAX_TEXT
    status, refused = answer(graph)
    assert status == 400 and f"exceed {MAX_DESCRIPTION} characters" in refused["error"], refused
    assert len(refused["error"]) < 300
    for i in (8, 9):
        del graph[str(i)]["inputs"]["blend_mode"]
    assert answer(graph)[0] == 200  # seven MiB and the rest: inside the bound


def test_the_chain_bound_holds_for_a_node_reached_again_deeper():
    """A memoized node reached again along a longer path still counts its own chain: the bound is per path, as it
    was when every path was walked."""

    def graph(references: int) -> dict:
        out = blend_chain(100, twice=False)
        out["enc"]["inputs"]["text_encoder"] = ["100", 0]  # walked first: the chain at depth 1
        previous = "ref"
        for i in range(references):  # then reached again at the end of a chain of references
            out[f"r{i}"] = {"class_type": "QI21Reference", "inputs": {"references": [previous, 0], "image": ["0", 0],
                                                                      "vae": ["vae", 0]}}
            previous = f"r{i}"
        out["enc"]["inputs"]["references"] = [previous, 0]
        out["ref"]["inputs"]["image"] = ["100", 0]
        return out

    route_key(graph(rk.MAX_DEPTH - 102), image_hashes=HASHES)  # 1 + 98 + 1 + 100 links: inside the bound
    with pytest.raises(RouteKeyError, match="links in one chain"):
        route_key(graph(rk.MAX_DEPTH - 101), image_hashes=HASHES)


@pytest.mark.parametrize("number", ["1" + "0" * 400, "-1" + "0" * 400, "1e400", "-1e400"])
def test_a_number_beyond_a_double_is_refused_by_name_with_400(number):
    graph = blend_chain(1)
    text = json.dumps({"prompt": graph, "image_hashes": HASHES}).replace('"bf16"', number)
    status, refused = observability.route_key_answer(text.encode())
    assert status == 400, refused
    assert "'dit' ('QI21ModelLoader') input 'weight_dtype'" in refused["error"]
    assert "does not fit a double" in refused["error"] or "not a finite number" in refused["error"]
    assert len(refused["error"]) < 200  # the 401 digits are not echoed
    assert answer(blend_chain(1))[0] == 200


def test_a_number_too_long_for_python_is_a_400_not_a_500():
    text = json.dumps({"prompt": blend_chain(1)}).replace('"bf16"', "1" * 5000)  # past int's 4300-digit limit
    status, refused = observability.route_key_answer(text.encode())
    assert status == 400 and "not JSON" in refused["error"] and len(refused["error"]) < 300


BIG = "x" * 10_000


def oversized_graphs() -> dict:
    def edited(node, name, value):
        graph = blend_chain(1)
        graph[node]["inputs"][name] = value
        return graph

    long_id = blend_chain(1)
    long_id[BIG] = long_id.pop("0")
    long_class = blend_chain(1)
    long_class["0"]["class_type"] = BIG
    long_input = blend_chain(1)
    long_input["1"]["inputs"][BIG] = {"an": "object"}
    return {
        "image name": (edited("0", "image", BIG), "expected a file name"),
        "image name in the output folder": (edited("0", "image", BIG + " [output]"), "expected a file name"),
        "link to a long id": (edited("1", "image1", [BIG, 0]), "not in the graph"),
        "link output index": (edited("1", "image1", ["0", 10 ** 400]), f"output index from 0 to {MAX_OUTPUT}"),
        "link to a huge int id": (edited("1", "image1", [10 ** 400, 0]), "a link must be"),
        "long node id": (long_id, f"at most {MAX_ID} characters"),
        "long class_type": (long_class, f"at most {MAX_ID} characters"),
        "long input name": (long_input, "expected a number, a string"),
        "long object value": (edited("1", "blend_mode", {BIG: BIG}), "expected a number, a string"),
        "long list value": (edited("1", "blend_mode", [BIG] * 3), "a link must be"),
        "huge int in a list": (edited("1", "blend_mode", [10 ** 5000, 0]), "a link must be"),
        "string past MAX_TEXT": (edited("1", "blend_mode", "y" * (rk.MAX_TEXT + 1)), "at most"),
    }


@pytest.mark.parametrize("case", sorted(oversized_graphs()))
def test_a_message_quotes_only_a_short_prefix_of_an_oversized_value(case):
    graph, message = oversized_graphs()[case]
    with pytest.raises(RouteKeyError, match=message) as refused:
        route_key(graph, image_hashes=HASHES)
    assert len(str(refused.value)) < 400, str(refused.value)[:500]


def test_node_ids_that_are_digits_but_not_ascii_are_ordered_not_refused():
    graph = blend_chain(1)
    graph["²"] = dict(graph.pop("sampler"))  # "²".isdigit() is True, int("²") raises
    status, answered = answer(graph)
    assert status == 200 and len(answered["route_key"]) == rk.KEY_LENGTH


def test_many_samplers_over_one_chain_share_its_descriptions(monkeypatch):
    graph = blend_chain(14)
    for i in range(12):  # each a different prefix (its own conditioning), so none is merged with another
        graph[f"enc{i}"] = dict(graph["enc"], inputs={**graph["enc"]["inputs"], "text_encoder": [f"te{i}", 0]})
        graph[f"te{i}"] = {"class_type": "QI21TextEncoderLoader", "inputs": {"text_encoder_name": f"te{i}",
                                                                             "weight_dtype": "default"}}
        graph[f"s{i}"] = {"class_type": "QI21Sampler", "inputs": {"model": ["dit", 0], "positive": [f"enc{i}", 0]}}
    walked = count_nodes_walked(monkeypatch)
    described = route_description(graph, image_hashes=HASHES)
    assert len(described["samplers"]) == 13 and len(walked) == len(set(walked)) == 14 + 5 + 2 * 12
