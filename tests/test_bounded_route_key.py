"""The route key's work is bounded by the graph (issue 58, item 1): each node is walked once however many inputs use
it, a description that would double at every link is refused before it is written out, numbers that do not fit a
double are refused by name with HTTP 400, and no message echoes an oversized value.

Found as a hostile API client: 40 chained ImageBlend nodes, each blending the one before with itself, never got an
answer (the key was computed once per path: depths 10 / 12 / 14 / 16 took 0.01 / 0.03 / 0.13 / 0.56 s), and
`weight_dtype` = 10^400 gave an HTTP 500 (OverflowError)."""

import json
import time

import pytest

from qi21.nodes import observability, route_key as rk
from qi21.nodes.route_key import MAX_DESCRIPTION, MAX_ID, MAX_OUTPUT, RouteKeyError, route_key, route_parts

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
    parts = route_parts(blend_chain(10), image_hashes=HASHES)
    assert sorted(walked) == sorted(set(walked)) and len(walked) == 10 + 5  # the blends, ref, vae, te, enc, dit
    # The description is the same nested one as ever: 2^10 copies of the image's hash, found by walking 10 nodes.
    assert json.dumps(parts).count("0" * 64) == 2 ** 10


def test_a_doubling_chain_is_refused_at_once_and_the_server_answers_the_next_graph():
    start = time.monotonic()
    status, refused = answer(blend_chain(40))
    assert time.monotonic() - start < 2.0  # was: never (2^40 walks)
    assert status == 400 and f"exceed {MAX_DESCRIPTION} characters" in refused["error"]
    assert "doubles at every link" in refused["error"]
    status, clean = answer(blend_chain(3))
    assert status == 200 and clean["route_key"] == route_key(blend_chain(3), image_hashes=HASHES)


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


def test_many_samplers_over_one_large_description_are_bounded_together():
    graph = blend_chain(14)  # about 1.5 MB written out per sampler
    for i in range(12):  # each a different prefix (its own conditioning), so none is merged with another
        graph[f"enc{i}"] = dict(graph["enc"], inputs={**graph["enc"]["inputs"], "text_encoder": ["te", 0],
                                                      "references": ["ref", 0]})
        graph[f"te{i}"] = {"class_type": "QI21TextEncoderLoader", "inputs": {"text_encoder_name": f"te{i}",
                                                                             "weight_dtype": "default"}}
        graph[f"enc{i}"]["inputs"]["text_encoder"] = [f"te{i}", 0]
        graph[f"s{i}"] = {"class_type": "QI21Sampler", "inputs": {"model": ["dit", 0], "positive": [f"enc{i}", 0]}}
    with pytest.raises(RouteKeyError, match="descriptions would exceed"):
        route_key(graph, image_hashes=HASHES)
