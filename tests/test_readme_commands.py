"""Every command in README.md and docs/*.md runs as written (issue 66, item 2): `python nodes/route_key.py ...` from
the docs once failed on an import (nodes/types.py shadowed Python's `types`), and nothing ran the docs' commands.

Each fenced ```bash command is either run here (`RUN`), from the repository root in a fresh process (`SHARED`: in the
--help forms' one), with only its
placeholders filled in (`out/toy_input`, where the demo writes its input images: a folder holding the images the
graph loads; `<sha256>`: their hash), or listed in `NOT_RUN` with the reason (long, real weights, ComfyUI, an
install): a command added to the docs fails `test_every_fenced_command_is_run_or_classified` until it is classified.
Every `python <script>` command of the docs, fenced or inline (`python benchmarks/memory.py host`), also has its
script checked: it exists, `<script> [QUESTION] --help` runs, and every `--flag` the docs give it is one the script
takes. The `--help` forms share one fresh process (each script run by `runpy` as `python` runs it, its folder first
on `sys.path`), so the torch imports are paid once."""

import hashlib
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ROUTE_GRAPH = "workflows/api/edit_one_reference.json"
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")

#: The fenced commands this test runs, each with what its output must show (a regular expression, searched).
RUN = {
    "ruff check .": r"All checks passed",
    "python locales/build_locales.py --check": r"",
    "python workflows/build_blueprints.py --check": r"",
    f"python nodes/route_key.py {ROUTE_GRAPH} --input-dir out/toy_input": r"^[0-9a-f]{32}\s*$",
    f"python nodes/route_key.py {ROUTE_GRAPH} --hash example.png=<sha256> --explain":
        r'"QI21Reference"[\s\S]*\n[0-9a-f]{32}\s*$',
    f"python deploy/qi21_client.py route-key {ROUTE_GRAPH} --input-dir out/toy_input": r"^[0-9a-f]{32}\s*$",
    f"python -m nodes.route_key {ROUTE_GRAPH} --input-dir out/toy_input": r"^[0-9a-f]{32}\s*$",
}

#: Commands of `RUN` run in the help forms' shared process (`script_runs`: they import torch, paid once there).
SHARED = {"python locales/build_locales.py --check"}

#: The fenced commands this test does not run, and why (their scripts' flags are still checked).
NOT_RUN = {
    "pip install torch==2.13.0": "installs into the environment (network)",
    'pip install ".[test]"': "installs into the environment (network); the `test` extra is checked in pyproject.toml",
    "python demo/run_workflows.py": "long: every shipped workflow on the trained toy",
    "python demo/run_workflows.py --random": "long: every shipped workflow in every file layout",
    "python demo/run_workflows.py --models /path/to/ComfyUI/models --out out": "needs real weights",
    "python demo/train_toy.py --out /tmp/toy": "long: trains the toy (about an hour on 2 cores)",
    "python -m pytest -q tests": "long: the whole suite (about 8 minutes on 2 cores)",
    "cd ComfyUI/custom_nodes": "needs a ComfyUI checkout",
    "git clone https://github.com/qi21/ComfyUI-QwenImage21": "needs ComfyUI and the network; requirements.txt is "
                                                             "checked",
    "python -m venv .venv && . .venv/bin/activate": "makes a virtual environment in the checkout",
    'python demo/run_workflows.py --only text_to_image_turbo --prompt "a large green circle on the left, black '
    'background" --seed 7': "long: a toy picture (tests/test_demo.py checks --only / --prompt / --seed)",
    'python demo/run_workflows.py --only img2img,official_t2i --prompt "a small red square at the top, white '
    'background" --seed 3': "long: two toy pictures (tests/test_demo.py checks --only / --prompt / --seed)",
    "pip install -r ComfyUI-QwenImage21/requirements.txt": "needs ComfyUI and the network",
    "python locales/build_locales.py": "writes locales/ (its --check form is run)",
    "apt-get install -y haproxy": "installs a system package (root, network)",
    "QI21_COMFYUI=/work/comfyui QI21_COMFYUI_PYTHON=/work/comfyvenv/bin/python python -m pytest -q -s "
    "tests/test_many_workers.py": "needs ComfyUI and HAProxy; the test file is checked",
    "python benchmarks/quality.py cases DIR": "writes the trained toy's files (20 MB) and its cases to DIR",
    "python benchmarks/quality.py step-cache --models DIR/models --prompts DIR/cases.json --steps 40 --threads 2 "
    "--settings t8 t8:0.12 t8:0.2 extrapolate": "long: the step cache's yardstick on the toy",
    "python benchmarks/quality.py step-cache --models DIR/models --prompts DIR/cases.json --steps 40 --threads 2 "
    "--control --settings t8 t8+recompute t8:0.2 t8:0.2+recompute": "long: the same with the Fun ControlNet",
    "QI21_COMFYUI=/work/comfyui QI21_COMFYUI_PYTHON=/work/comfyvenv/bin/python python benchmarks/comfyui.py "
    "step-cache --threads 1": "needs ComfyUI",
}

#: Script paths of the docs that name no file: placeholders, with what they stand for.
PLACEHOLDER_SCRIPTS = {"benchmarks/SCRIPT.py": "any script of benchmarks/ (each is checked on its own)"}


def doc_name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def fenced_commands() -> list[tuple[str, str]]:
    """(document, command) of each ```bash block's lines: continuation lines joined, comments and blank lines
    dropped."""
    found = []
    for path in DOCS:
        for block in re.findall(r"^```bash\n(.*?)^```", path.read_text(), re.S | re.M):
            for line in block.replace("\\\n", " ").splitlines():
                command = " ".join(line.split(" #", 1)[0].split())
                if command and not command.startswith("#"):
                    found.append((doc_name(path), command))
    return found


def inline_commands() -> list[tuple[str, str]]:
    """(document, command) of each inline code span outside the fenced blocks that starts a `python` command."""
    found = []
    for path in DOCS:
        text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
        for span in re.findall(r"`([^`]+)`", text):
            command = " ".join(span.split())
            if re.match(r"(\w+=\S+ )*python ", command):
                found.append((doc_name(path), command))
    return found


def python_commands() -> list[tuple[str, str, list[str]]]:
    """(document, command, its words after `python`, environment settings dropped) of every python command."""
    out = []
    for doc, command in fenced_commands() + inline_commands():
        words = shlex.split(command)
        while words and re.fullmatch(r"\w+=\S*", words[0]):
            words.pop(0)
        if words and words[0] == "python":
            out.append((doc, command, words[1:]))
    return out


def has_questions(script: str) -> bool:
    """Whether the script's first argument is a question or a sub-command (benchmarks/speed.py dit ...,
    deploy/qi21_client.py route-key ...), with its own --help."""
    text = (ROOT / script).read_text()
    return "\nQUESTIONS = {" in text or ".add_subparsers(" in text


def help_forms() -> dict[tuple[str, ...], tuple[set, list]]:
    """(script, question or nothing) -> (the flags the docs give it, where)."""
    forms = {}
    for doc, command, words in python_commands():
        if words[0] == "-m":
            continue  # python -m pytest / nodes.route_key: checked by test_module_commands_and_named_files_exist
        script = words[0]
        if script in PLACEHOLDER_SCRIPTS:
            continue
        assert (ROOT / script).is_file(), f"{doc}: `{command}` names {script}, which is not in the repository"
        key = (script, words[1]) if has_questions(script) and len(words) > 1 else (script,)
        flags, where = forms.setdefault(key, (set(), []))
        flags |= set(FLAG.findall(" ".join(words[1:])))
        where.append(f"{doc}: `{command}`")
    return forms


RUNNER = """
import contextlib, io, json, runpy, sys
results = []
for script, argv in json.loads(sys.argv[1]):
    saved_path, saved_argv, out = list(sys.path), list(sys.argv), io.StringIO()
    sys.path[0], sys.argv = script.rsplit('/', 1)[0], [script, *argv]
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            runpy.run_path(script, run_name='__main__')
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
            if exit.code is not None and not isinstance(exit.code, int):
                print(exit.code)
    sys.path[:], sys.argv = saved_path, saved_argv
    results.append([code, out.getvalue()])
print(json.dumps(results))
"""


def run_scripts(runs: list[tuple[str, list[str]]], cwd: Path) -> list[tuple[int, str]]:
    """Each (script, argv) run as `python script *argv` would, all in one fresh process started in `cwd`."""
    done = subprocess.run([sys.executable, "-c", RUNNER, json.dumps([[str(ROOT / s), a] for s, a in runs])],
                          cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [tuple(result) for result in json.loads(done.stdout.splitlines()[-1])]


def test_every_fenced_command_is_run_or_classified():
    found = fenced_commands()
    assert len(found) >= 20, found  # the parser reads the docs' blocks
    commands = {command for _, command in found}
    unknown = [f"{doc}: {command}" for doc, command in found if command not in RUN and command not in NOT_RUN]
    assert not unknown, ("commands in the docs that this test neither runs nor lists in NOT_RUN with a reason: "
                         + "; ".join(unknown))
    stale = sorted((set(RUN) | set(NOT_RUN)) - commands)
    assert not stale, f"classified commands no document holds any more: {stale}"


def test_the_commands_that_are_cheap_run_as_written(tmp_path, script_runs):
    """From the repository root in a fresh process each, only the placeholders filled in: the input folder the demo
    writes (`out/toy_input`) is a folder holding the images the route-key graph loads, `<sha256>` their hash."""
    toy_input = tmp_path / "toy_input"
    toy_input.mkdir()
    graph = json.loads((ROOT / ROUTE_GRAPH).read_text())
    names = {n["inputs"]["image"] for n in graph.values() if n["class_type"] == "LoadImage"}
    assert names == {"example.png"}, names  # what the docs' --hash names
    (toy_input / "example.png").write_bytes(b"the pixels of example.png")
    placeholders = {"out/toy_input": str(toy_input),
                    "<sha256>": hashlib.sha256(b"the pixels of example.png").hexdigest()}
    keys = set()
    for command, expected in RUN.items():
        if command in SHARED:
            code, stdout = script_runs[2][command]
        else:
            for placeholder, value in placeholders.items():
                command = command.replace(placeholder, value)
            words = [sys.executable if w == "python" else w for w in shlex.split(command)]
            done = subprocess.run(words, cwd=ROOT, capture_output=True, text=True, timeout=120)
            code, stdout = done.returncode, done.stdout + done.stderr
        assert code == 0, f"`{command}` failed:\n{stdout[-3000:]}"
        assert re.search(expected, stdout), f"`{command}` printed:\n{stdout[-2000:]}"
        if "route" in command:
            keys.add(stdout.split()[-1])
    assert len(keys) == 1, keys  # the four forms give the one key of the graph


PLAN_TABLE = ("benchmarks/memory.py", "plan-table")


@pytest.fixture(scope="module")
def script_runs(tmp_path_factory) -> tuple[dict, tuple, dict, Path]:
    """In one fresh process, started in an empty folder (a --help that did work would write there; none of these
    reads the folder it starts in): the help forms (`help_forms()`: (script, question) -> (code, output)), the plan
    table's (code, output), the `SHARED` commands' ({command: (code, output)}), and that folder."""
    folder = tmp_path_factory.mktemp("scripts_run")
    forms = sorted(help_forms())
    shared = sorted(SHARED)
    runs = [(key[0], [*key[1:], "--help"]) for key in forms] + [(PLAN_TABLE[0], [PLAN_TABLE[1]])]
    runs += [(shlex.split(command)[1], shlex.split(command)[2:]) for command in shared]
    results = run_scripts(runs, folder)
    return (dict(zip(forms, results)), results[len(forms)], dict(zip(shared, results[len(forms) + 1:])), folder)


def test_every_documented_script_takes_the_flags_the_docs_give_it(script_runs):
    """`<script> [QUESTION] --help` for each script and question of the docs exits 0 without doing the work, and
    each documented flag is in its help."""
    helps, _, _, folder = script_runs
    forms = help_forms()
    assert len(forms) >= 20 and set(helps) == set(forms), sorted(forms)
    problems = []
    for key, (code, text) in sorted(helps.items()):
        flags, where = forms[key]
        shown = set(FLAG.findall(text))
        if code != 0 or "usage:" not in text:
            problems.append(f"`python {' '.join(key)} --help` exited {code}: {text[-500:]} (from {where[0]})")
        elif flags - shown:
            problems.append(f"`python {' '.join(key)}` takes no {sorted(flags - shown)} (from {'; '.join(where)})")
    assert not problems, "\n".join(problems)
    assert not list(folder.iterdir()), list(folder.iterdir())  # nothing wrote anything


def test_the_plan_table_command_prints_the_table_the_docs_show(script_runs):
    command = "python " + " ".join(PLAN_TABLE)
    assert any(command in path.read_text() for path in DOCS), "the docs no longer give the plan table"
    code, text = script_runs[1]
    assert code == 0, text[-2000:]
    rows = [line for line in text.splitlines() if re.match(r"\| \d+ GB \| (t2i|edit)", line)]
    documented = (ROOT / "docs" / "measurements.md").read_text()
    assert len(rows) >= 12 and all(row in documented for row in rows), [r for r in rows if r not in documented][:3]


def test_module_commands_and_named_files_exist():
    """`python -m` commands name an importable module from the root and existing test files; the install commands'
    extra and requirements file exist."""
    for doc, command, words in python_commands():
        if words[0] != "-m":
            continue
        module = words[1]
        assert module in {"pytest", "nodes.route_key", "venv"}, f"{doc}: `{command}`: a module this test does not know"
        for word in words[2:]:
            if word.startswith("tests"):
                assert (ROOT / word.split("::")[0]).exists(), f"{doc}: `{command}` names {word}, which does not exist"
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r"^test = \[", pyproject, re.M), "pip install \".[test]\": pyproject.toml has no `test` extra"
    assert (ROOT / "requirements.txt").is_file()


@pytest.mark.parametrize("form", [["nodes/route_key.py"], ["-m", "nodes.route_key"]])
def test_the_route_key_runs_as_a_script_and_as_a_module_from_the_root(form, tmp_path):
    """Both forms print the key a shipped workflow has, given its image's hash (the route-key test module checks
    the key itself)."""
    digest = "ab" * 32
    done = subprocess.run([sys.executable, *form, ROUTE_GRAPH, "--hash", f"example.png={digest}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and re.fullmatch(r"[0-9a-f]{32}\n", done.stdout), done.stderr[-2000:]
