"""The front-end translations in locales/: English equal to the node schemas, Chinese with exactly the same keys,
every message translated (locales/build_locales.py writes both; ComfyUI serves them at /i18n)."""

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("qi21_build_locales", ROOT / "locales" / "build_locales.py")
build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build)

CJK = re.compile(r"[\u4e00-\u9fff]")
#: What a translation must carry over unchanged: reference placeholders and file names.
LITERALS = re.compile(r"<image\d+>|<imageN>|[\w.]+\.(?:safetensors|gguf|json)\b")


def committed(language: str) -> dict:
    return json.loads((ROOT / "locales" / language / "main.json").read_text(encoding="utf-8"))


def paths(tree, prefix=()) -> list[tuple]:
    if isinstance(tree, dict):
        return [p for key, value in tree.items() for p in paths(value, (*prefix, key))]
    return [prefix]


def leaves(tree) -> dict[tuple, str]:
    flat = {}
    for path in paths(tree):
        value = tree
        for key in path:
            value = value[key]
        flat[path] = value
    return flat


def test_committed_locales_are_what_the_schemas_give():
    assert build.stale() == [], "run: python locales/build_locales.py"


def test_every_node_is_described_in_english():
    nodes, _ = build.load_nodes()
    defs = committed("en")["nodeDefs"]
    assert list(defs) == [n.define_schema().node_id for n in nodes]
    for node in nodes:
        schema = node.define_schema()
        assert defs[schema.node_id]["display_name"] == schema.display_name
        assert set(i.id for i in schema.inputs) <= set(defs[schema.node_id]["inputs"])
        assert len(defs[schema.node_id]["outputs"]) == len(schema.outputs)


@pytest.mark.parametrize("language", sorted(build.TRANSLATIONS))
def test_translation_has_exactly_the_english_keys(language):
    assert paths(committed(language)) == paths(committed("en"))


@pytest.mark.parametrize("language", sorted(build.TRANSLATIONS))
def test_every_message_is_translated(language):
    english, translated = leaves(committed("en")), leaves(committed(language))
    untranslated = [(path, english[path]) for path, text in translated.items()
                    if not text.strip() or (english[path] not in build.KEPT_IN_LATIN and not CJK.search(text))]
    assert untranslated == []


@pytest.mark.parametrize("language", sorted(build.TRANSLATIONS))
def test_translations_keep_placeholders_and_file_names(language):
    for source, text in build.load_table(language).items():
        assert sorted(LITERALS.findall(source)) == sorted(LITERALS.findall(text)), source


def test_a_changed_english_string_has_no_translation_until_one_is_written():
    table = build.load_table("zh")
    tree = {"nodeDefs": {"X": {"display_name": "Qwen-Image 2.1 Sampler", "description": "A new sentence."}}}
    with pytest.raises(KeyError, match="A new sentence"):
        build.translate(tree, table)
    assert build.translate({"a": "Qwen-Image 2.1 Sampler"}, table) == {"a": "Qwen-Image 2.1 采样器"}
    assert "Qwen-Image 2.1 Sampler" not in build.unused(build.english(), table)
    assert build.unused({"a": "seed"}, {"seed": "种子", "gone": "旧"}) == ["gone"]
