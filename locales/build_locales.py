"""Writes the pack's front-end translations, `locales/<lang>/main.json`, from the nodes' `define_schema()`.

    python locales/build_locales.py           write locales/en/main.json and locales/zh/main.json
    python locales/build_locales.py --check   exit 1 when a file on disk differs from what this script writes

ComfyUI serves every custom node's `locales/<lang>/main.json` at /i18n (app/custom_node_manager.py) and the front
end merges it into its own messages: `nodeDefs.<node id>.display_name`, `.description`, `.inputs.<input>.name` and
`.tooltip`, `.outputs.<index>.name` and `.tooltip`, the layout of the front end's own nodeDefs locale. English is the
schemas' text, so it cannot drift from them (`--check`, run by tests/test_locales.py, catches a stale file). Chinese
comes from `zh_strings.json`, keyed by the English text: a changed or new English string has no translation until
someone writes one, and the build says which.
"""

import argparse
import importlib
import importlib.util
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TRANSLATIONS = {"zh": HERE / "zh_strings.json"}
#: The widget the front end adds after a seed with `control_after_generate`, named as in its English locale.
CONTROL_AFTER_GENERATE = ("control_after_generate", "control after generate")
#: English terms a Chinese ComfyUI shows as they are (core's own zh locale keeps cfg, vae, Latent, Sigmas).
KEPT_IN_LATIN = frozenset({"cfg", "vae", "LATENT", "SIGMAS", "sigmas", "RGBA"})


def load_nodes():
    """The pack's node classes and its widget-option reader, the repository imported as `qi21` (demo/pack_import.py,
    loaded by its path: run as a script, Python puts locales/ on sys.path, not the repository)."""
    spec = importlib.util.spec_from_file_location("qi21_pack_import", ROOT / "demo" / "pack_import.py")
    helper = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helper)
    pack = helper.import_pack().__name__
    return (importlib.import_module(f"{pack}.nodes").NODES,
            importlib.import_module(f"{pack}.nodes.validation").widget_option)


def i18n_key(name: str) -> str:
    """The front end's normalizeI18nKey: a dot would open a nested message, so it becomes an underscore."""
    return name.replace(".", "_")


def node_messages(schema, option) -> dict:
    inputs = {}
    for spec in schema.inputs:
        entry = {"name": spec.display_name or spec.id}
        if spec.tooltip:
            entry["tooltip"] = spec.tooltip
        inputs[i18n_key(spec.id)] = entry
        if option(spec, "control_after_generate"):
            inputs[CONTROL_AFTER_GENERATE[0]] = {"name": CONTROL_AFTER_GENERATE[1]}
    outputs = {}
    for index, spec in enumerate(schema.outputs):
        outputs[str(index)] = {"name": spec.display_name or spec.io_type}
        if spec.tooltip:
            outputs[str(index)]["tooltip"] = spec.tooltip
    messages = {"display_name": schema.display_name or schema.node_id}
    if schema.description:
        messages["description"] = schema.description
    return messages | {"inputs": inputs, "outputs": outputs}


def english() -> dict:
    nodes, option = load_nodes()
    return {"nodeDefs": {i18n_key(s.node_id): node_messages(s, option) for s in (n.define_schema() for n in nodes)}}


def strings(tree) -> list[str]:
    """Every message of a tree, in order."""
    if isinstance(tree, dict):
        return [text for value in tree.values() for text in strings(value)]
    return [tree]


def translate(tree, table: dict[str, str]):
    """The same tree with each English message replaced by its translation; every one must have one."""
    if missing := [text for text in dict.fromkeys(strings(tree)) if text not in table]:
        raise KeyError("no translation for:\n" + "\n".join(f"  {text!r}" for text in missing))
    def walk(node):
        return {key: walk(value) for key, value in node.items()} if isinstance(node, dict) else table[node]
    return walk(tree)


def unused(tree, table: dict[str, str]) -> list[str]:
    """Translations of English text that no schema has any more."""
    return sorted(set(table) - set(strings(tree)))


def load_table(language: str) -> dict[str, str]:
    return json.loads(TRANSLATIONS[language].read_text(encoding="utf-8"))


def _dumps(data) -> str:
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


def expected_files() -> dict[str, str]:
    """Relative path (under locales/) -> file text."""
    source = english()
    files = {"en/main.json": _dumps(source)}
    for language in TRANSLATIONS:
        files[f"{language}/main.json"] = _dumps(translate(source, load_table(language)))
    return files


def stale(folder: Path = HERE) -> list[str]:
    source = english()
    problems = [f"{language}: unused translation {text!r}" for language in TRANSLATIONS
                for text in unused(source, load_table(language))]
    for relative, text in expected_files().items():
        path = folder / relative
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            problems.append(f"{relative}: missing or differs from the builder's output")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if the files on disk are not up to date")
    args = parser.parse_args(argv)
    if args.check:
        problems = stale()
        for problem in problems:
            print(f"stale: {problem}", file=sys.stderr)
        if problems:
            print("run: python locales/build_locales.py", file=sys.stderr)
        return 1 if problems else 0
    for relative, text in expected_files().items():
        path = HERE / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(f"wrote locales/{relative}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
