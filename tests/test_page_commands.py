"""Every command a page shows works as pasted in a new shell, after the README's set-up.

A new shell has no venv active, so the pages name the venv's interpreter (``.venv/bin/python``,
``.venv/bin/torchrun``), from the repository's root. Here, on every page, no command starts
with a bare ``python``, ``torchrun`` or ``pytest`` (those would be the system's, without torch);
and every command of the README's examples table and of each example's "Run it" is run the way
the page says, in a clean environment (no venv on PATH, no PYTHONPATH): its interpreter and
imports through ``--help``, its flags through the example's own parser and checks.
The runs themselves are tested beside each example (its README's output, its parity).
"""
from __future__ import annotations

import importlib
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from conftest import REPO
from test_tutorial_maps import EXAMPLES, MARKDOWN

VENV_PYTHON = REPO / ".venv" / "bin" / "python"
# a command's first word, in a code block or an inline span: at the start, or after && ; | $
BARE = re.compile(r"(?:^|&&\s*|;\s*|\|\s*|\$\s+|srun(?:\s+-\S+(?:\s+\d+)?)*\s+)(python3?|torchrun|pytest|pip)\s")


def code_blocks(md: Path) -> list[tuple[str, list[str]]]:
    """(language, lines) of every fenced block of ``md``."""
    blocks, lang, lines = [], None, []
    for line in md.read_text().splitlines():
        if line.startswith("```"):
            if lang is None:
                lang, lines = line[3:].strip(), []
            else:
                blocks.append((lang, lines))
                lang = None
        elif lang is not None:
            lines.append(line)
    return blocks


def bare_commands(md: Path) -> list[str]:
    """The commands of ``md`` that start with the system's interpreter, not the venv's
    (``python3 -m venv`` aside: the set-up itself)."""
    found = []
    shell = [l for lang, lines in code_blocks(md) if lang in ("bash", "sh", "console", "") for l in lines]
    # an inline span may wrap onto the next line of the paragraph
    inline = [" ".join(span.split()) for span in
              re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", md.read_text(), flags=re.S))]
    for text in shell + inline:
        for match in BARE.finditer(text.strip()):
            if not text.strip()[match.start(1):].startswith("python3 -m venv"):
                found.append(text.strip())
    return found


@pytest.mark.parametrize("md", MARKDOWN, ids=[str(m.relative_to(REPO)) for m in MARKDOWN])
def test_no_page_shows_a_command_for_the_system_python(md):
    assert not bare_commands(md), "commands that a new shell runs without the venv:\n" + "\n".join(bare_commands(md))


def test_a_bare_python_command_is_found(tmp_path):
    md = tmp_path / "README.md"
    md.write_text("Run `python rpc_rl/main.py`.\n\n```bash\npython3 -m venv .venv && .venv/bin/pip install -e .\n"
                  ".venv/bin/python x.py\ntorchrun --nproc_per_node 2 x.py   # two\n"
                  "srun -n 2 --kill-on-bad-exit=1 python y.py\n```\nOr `python z.py\n--flag`, wrapped.\n")
    assert bare_commands(md) == ["torchrun --nproc_per_node 2 x.py   # two",
                                 "srun -n 2 --kill-on-bad-exit=1 python y.py", "python rpc_rl/main.py",
                                 "python z.py --flag"]


def page_commands() -> list[tuple[str, str]]:
    """(page, command) for each command of the README's examples table and of every example
    README's "Run it" block."""
    found = []
    readme = (REPO / "README.md").read_text()
    table = readme.split("## The examples", 1)[1].split("\n## ", 1)[0]
    for row in table.splitlines():
        if row.startswith("|") and ".venv/bin/" in row:
            found.append(("README.md", re.findall(r"`(\.venv/bin/[^`]+)`", row)[-1]))
    for md in (REPO / example / "README.md" for example in EXAMPLES):
        section = md.read_text().split("## Run it", 1)[1].split("\n## ", 1)[0]
        block = section.split("```bash\n", 1)[1].split("```", 1)[0]
        found += [(str(md.relative_to(REPO)), line.split(" #")[0].strip())
                  for line in block.splitlines() if line.strip() and not line.startswith("#")]
    return found


COMMANDS = page_commands()


def script_and_flags(command: str) -> tuple[str, list[str]]:
    """The example script a command runs, and its own flags (after torchrun's)."""
    argv = shlex.split(command)
    script = next(a for a in argv if a.endswith(".py"))
    return script, argv[argv.index(script) + 1:]


def test_every_example_and_its_run_it_commands_are_collected():
    pages = {page for page, _ in COMMANDS}
    assert pages == {"README.md", *(f"{example}/README.md" for example in EXAMPLES)}, pages
    scripts = {script_and_flags(c)[0] for _, c in COMMANDS}
    assert {"rpc_rl/main.py", "rpc_rnn/main.py", "ddp_rpc/main.py", "rpc_pipeline_resnet/main.py",
            "rpc_pipeline_resnet/pipelining.py", "pipelining_transformer/main.py"} <= scripts, scripts


@pytest.mark.parametrize("page,command", COMMANDS, ids=[f"{p}: {c}" for p, c in COMMANDS])
def test_every_run_it_command_parses_with_its_example(page, command):
    script, flags = script_and_flags(command)
    module = importlib.import_module(script.removesuffix(".py").replace("/", "."))
    parser = module.build_parser()
    args = parser.parse_args(flags)
    if hasattr(module, "check_args"):
        module.check_args(parser, args)  # refuses (exit 2) what the example would refuse


def clean_env() -> dict[str, str]:
    """A new shell's environment: no venv on PATH, nothing of this test run's."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root"), "LANG": "C.UTF-8"}


# one --help a launcher and script: the interpreter, its torch and the example's imports
LAUNCHES = sorted({(shlex.split(c)[0], script_and_flags(c)[0]) for _, c in COMMANDS})


@pytest.mark.skipif(not VENV_PYTHON.exists(), reason="the README's set-up makes .venv; this run has another venv")
@pytest.mark.parametrize("launcher,script", LAUNCHES, ids=[f"{l} {s}" for l, s in LAUNCHES])
def test_every_run_it_launcher_starts_its_script_in_a_new_shell(launcher, script):
    command = next(c for _, c in COMMANDS if shlex.split(c)[0] == launcher and script_and_flags(c)[0] == script)
    cut = command[:command.index(script) + len(script)]  # launcher, its flags, the script
    proc = subprocess.run(["bash", "-c", f"{cut} --help"], cwd=REPO, env=clean_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{cut} --help\n{proc.stdout}{proc.stderr}"
    assert "usage:" in proc.stdout, proc.stdout
