"""Every example README's map from tutorial steps to code points at lines that exist.

Each example README has a section "## Where each tutorial step is" with a table whose rows
read ``| tutorial step | `name` | [file.py#L<n>](file.py#L<n>) |``. A row's ``name`` (the
first backticked text of its second cell) must appear on line ``n`` of ``file.py`` (a path
relative to the README), so a map cannot rot when code moves: this test fails instead.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = pytest.mark.fast

EXAMPLES = ["rpc_rl", "ddp_rpc", "rpc_rnn", "rpc_pipeline_resnet", "pipelining_transformer"]
HEADING = "## Where each tutorial step is"
LINK = re.compile(r"\]\(([^)#\s]+)#L(\d+)\)")
NAME = re.compile(r"`([^`]+)`")


def map_rows(readme: Path, heading: str = HEADING) -> list[tuple[str, str, int]]:
    """(name, path relative to the README, line) for every link in the tables of the README's
    section ``heading``: each cell holding a ``file.py#L<n>`` link names, in the cell before
    it, the first backticked text that line must hold (a step map has one such pair per row,
    the RPC-to-pipelining bridge two)."""
    text = readme.read_text()
    assert heading in text, f"{readme} has no section {heading!r}"
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        if not line.lstrip().startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        for before, cell in zip(cells, cells[1:]):
            link, name = LINK.search(cell), NAME.search(before)
            if link is not None and name is not None:
                rows.append((name.group(1), link.group(1), int(link.group(2))))
    return rows


def problems(readme: Path, heading: str = HEADING) -> list[str]:
    """Why rows of ``readme``'s map point at the wrong place (empty: none)."""
    found = []
    for name, rel, line in map_rows(readme, heading):
        path = readme.parent / rel
        if not path.is_file():
            found.append(f"{rel}#L{line}: no such file")
            continue
        lines = path.read_text().splitlines()
        if not 1 <= line <= len(lines):
            found.append(f"{rel}#L{line}: {rel} has {len(lines)} lines")
        elif name not in lines[line - 1]:
            found.append(f"{rel}#L{line}: {name!r} is not on that line: {lines[line - 1].strip()!r}")
    return found


@pytest.mark.parametrize("example", EXAMPLES)
def test_every_step_of_the_map_is_on_its_line(example):
    readme = REPO / example / "README.md"
    rows = map_rows(readme)
    assert len(rows) >= 5, f"{readme}: the step map has {len(rows)} rows, expected every step"
    assert not problems(readme), "\n".join(problems(readme))


BRIDGE = "## The same pipeline with torch.distributed.pipelining"


def test_every_rpc_idea_and_its_pipelining_counterpart_are_on_their_lines():
    """rpc_pipeline_resnet's bridge: each RPC idea and its pipelining counterpart, both linked."""
    readme = REPO / "rpc_pipeline_resnet" / "README.md"
    rows = map_rows(readme, BRIDGE)
    files = {rel for _, rel, _ in rows}
    assert {"main.py", "model.py", "pipelining.py"} <= files and len(rows) >= 16, rows
    assert not problems(readme, BRIDGE), "\n".join(problems(readme, BRIDGE))


LINE_LINK = re.compile(r"\[[^\]]*\]\(([^)#\s]+)#L(\d+)\)")


def every_link(md: Path) -> list[tuple[str | None, str, int]]:
    """(name, path relative to ``md``, line) for every ``file#L<n>`` link anywhere in ``md``.

    In a table row the name is the first backticked text of the cell before the link's (as
    in the step maps); in prose, the nearest backticked text before the link in its
    paragraph (``train`` in "`train` ([main.py#L234](main.py#L234))"). None: no name given.
    """
    found = []
    paragraph: list[str] = []
    for line in [*md.read_text().splitlines(), ""]:
        if line.lstrip().startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            for before, cell in zip(["", *cells], cells):
                for link in LINE_LINK.finditer(cell):
                    name = NAME.search(before)
                    found.append((name.group(1) if name else None, link.group(1), int(link.group(2))))
        elif line.strip():
            paragraph.append(line)
            continue
        text = " ".join(paragraph)
        for link in LINE_LINK.finditer(text):
            names = NAME.findall(text[:link.start()])
            found.append((names[-1] if names else None, link.group(1), int(link.group(2))))
        paragraph = []
    return found


def link_problems(md: Path) -> list[str]:
    """Why links of ``md`` point at the wrong place (empty: none)."""
    found = []
    for name, rel, line in every_link(md):
        path = md.parent / rel
        where = f"{md.relative_to(md.parents[1]) if len(md.parents) > 1 else md.name}: {rel}#L{line}"
        if name is None:
            found.append(f"{where}: the link names no code (no `name` before it)")
        elif not path.is_file():
            found.append(f"{where}: no such file")
        elif not 1 <= line <= len(lines := path.read_text().splitlines()):
            found.append(f"{where}: {rel} has {len(lines)} lines")
        elif name not in lines[line - 1]:
            found.append(f"{where}: {name!r} is not on that line: {lines[line - 1].strip()!r}")
    return found


MARKDOWN = sorted({*REPO.glob("*.md"), *REPO.glob("*/README.md"), *REPO.glob("docs/**/*.md")})


@pytest.mark.parametrize("md", MARKDOWN, ids=[str(m.relative_to(REPO)) for m in MARKDOWN])
def test_every_line_link_anywhere_points_at_its_name(md):
    """Every ``file.py#L<n>`` in a README or under docs/, in a table or in prose."""
    assert not link_problems(md), "\n".join(link_problems(md))


def test_a_prose_link_one_line_off_fails(tmp_path):
    (tmp_path / "main.py").write_text("import torch\n\ndef train():\n    pass\n")
    md = tmp_path / "README.md"
    md.write_text("The loop is `train`\n([main.py#L3](main.py#L3)).\n\nAlso [here](main.py#L3).\n")
    assert link_problems(md) == [f"{tmp_path.name}/README.md: main.py#L3: the link names no code "
                                 "(no `name` before it)"]
    md.write_text("The loop is `train` ([main.py#L2](main.py#L2)).\n")
    assert link_problems(md) == [f"{tmp_path.name}/README.md: main.py#L2: 'train' is not on that "
                                 "line: ''"]


def test_a_row_pointed_at_a_wrong_line_fails(tmp_path):
    """The check itself can fail: a row one line off, and one whose file is gone."""
    (tmp_path / "main.py").write_text("import torch\n\ndef run_master():\n    pass\n")
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{HEADING}\n\n| step | code | where |\n|---|---|---|\n"
                      "| loop | `run_master` | [main.py#L3](main.py#L3) |\n")
    assert problems(readme) == []
    readme.write_text(readme.read_text().replace("#L3", "#L2")
                      + "| gone | `x` | [other.py#L1](other.py#L1) |\n")
    assert problems(readme) == [
        "main.py#L2: 'run_master' is not on that line: ''",
        "other.py#L1: no such file",
    ]
    # a bridge row: both sides checked, the second one off here
    readme.write_text(f"# x\n\n{BRIDGE}\n\n| idea | rpc | where | pp | where |\n|---|---|---|---|---|\n"
                      "| loop | `run_master` | [main.py#L3](main.py#L3) | `pass` | [main.py#L3](main.py#L3) |\n")
    assert problems(readme, BRIDGE) == ["main.py#L3: 'pass' is not on that line: 'def run_master():'"]
