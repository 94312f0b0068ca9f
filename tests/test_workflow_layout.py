"""The shipped UI workflows' layout, read from the saved files: no node over another, every size at least what the
front end draws, positions on the grid, groups that hold whole nodes and cross nothing (workflows/workflow_layout.py
lays them out; tests/test_comfyui_browser_locale.py checks the same in the real front end)."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("qi21_build_workflows", ROOT / "workflows" / "build_workflows.py")
build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build)
layout = build.sys.modules["workflow_layout"]

UI_FILES = sorted((ROOT / "workflows").glob("*.json"))
#: The group titles of core's Qwen-Image 2.1 templates (comfyui-workflow-templates-json 0.1.123) that ours reuse.
CORE_GROUPS = {"Models", "Prompt Enhancer", "Conditioning", "Sampling", "Image Size"}


def saved_layout(workflow: dict) -> tuple[list, list]:
    """(name, pos, size) of each node and (title, bounding, names inside) of each group: the front end counts a
    node as a group's when the node lies inside it."""
    nodes = [(f"#{n['id']} {n.get('title') or n['type']}", n["pos"], n["size"]) for n in workflow["nodes"]]
    groups = []
    for group in workflow["groups"]:
        x, y, w, h = group["bounding"]
        inside = {name for name, pos, size in nodes if _within(layout.rect(pos, size), (x, y, x + w, y + h))}
        groups.append((group["title"], group["bounding"], inside))
    return nodes, groups


def _within(inner, outer) -> bool:
    return outer[0] <= inner[0] and outer[1] <= inner[1] and inner[2] <= outer[2] and inner[3] <= outer[3]


@pytest.fixture(scope="module")
def specs():
    return build.load_specs()


@pytest.mark.parametrize("path", UI_FILES, ids=[p.stem for p in UI_FILES])
def test_no_node_overlaps_another_or_a_foreign_group(path):
    assert layout.overlaps(*saved_layout(json.loads(path.read_text()))) == []


@pytest.mark.parametrize("path", UI_FILES, ids=[p.stem for p in UI_FILES])
def test_sizes_are_at_least_what_the_front_end_draws_and_on_the_grid(path, specs):
    for node in json.loads(path.read_text())["nodes"]:
        assert node["size"][1] >= layout.min_height(specs[node["type"]]), f"{path.name}: #{node['id']} too short"
        assert all(v % layout.GRID == 0 for v in [*node["pos"], *node["size"]]), f"{path.name}: #{node['id']}"


@pytest.mark.parametrize("path", UI_FILES, ids=[p.stem for p in UI_FILES])
def test_groups_are_core_templates_groups_and_hold_nodes(path):
    workflow = json.loads(path.read_text())
    _, groups = saved_layout(workflow)
    assert {title for title, *_ in groups} <= CORE_GROUPS
    assert all(inside for *_, inside in groups), f"{path.name}: an empty group"
    if path.stem.startswith("official_"):
        titles = {title for title, *_ in groups}
        assert {"Models", "Conditioning", "Sampling"} <= titles
        assert ("Prompt Enhancer" in titles) == any(n["type"] == "TextGenerate" for n in workflow["nodes"])


def test_the_check_sees_an_overlap_and_a_node_half_in_a_group():
    a, b = ("a", (0, 100), (200, 100)), ("b", (150, 150), (200, 100))
    assert layout.overlaps([a, b], []) == ["a overlaps b"]
    clear = ("c", (400, 100), (100, 100))
    assert layout.overlaps([a, clear], [("G", (-10, 20, 470, 200), {"a"})]) == ["group 'G' covers c"]


def test_nodes_hinted_at_one_place_are_stacked_and_columns_pushed_apart(specs):
    graph = build.Graph("layout_probe", specs)
    first = graph.add("QI21Sampler", (0, 100), (300, 100), seed=1)
    second = graph.add("QI21VAEDecode", (0, 100), (300, 100))
    beside = graph.add("QI21VAEDecode", (100, 100), (300, 100))
    graph.group("Sampling", first)
    graph.arrange()
    assert first.size[1] >= layout.min_height(first.spec) > 100
    assert second.pos[0] == first.pos[0] and second.pos[1] - layout.TITLE >= first.pos[1] + first.size[1]
    assert beside.pos[0] >= first.pos[0] + first.size[0] + layout.COLUMN_GAP
