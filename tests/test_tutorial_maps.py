"""Every example README's map from tutorial steps to code points at lines that exist.

Each example README has a section "## Where each tutorial step is" with a table whose rows
read ``| tutorial step | `name` | [file.py#L<n>](file.py#L<n>) |``. A row's ``name`` (the
first backticked text of its second cell) must appear on line ``n`` of ``file.py`` (a path
relative to the README), so a map cannot rot when code moves: this test fails instead.

The code side of the same promise: every program that launches ranks launches them as its tutorial
does, ``mp.spawn(run_worker, ..., join=True)`` (or ``run_worker`` under torchrun), with nothing of
distkit inside the tutorial's ``init_process_group`` call (``launch_problems``).
"""
from __future__ import annotations

import ast
import importlib
import re
from collections import defaultdict
from pathlib import Path

import pytest

from conftest import DIFFERS, HEADING, REPO
from tutorial_lines_ddp_rpc import DDP_RPC_NAMES, DDP_RPC_TUTORIAL
from tutorial_lines_pipelining import PIPELINING_NAMES, PIPELINING_TUTORIAL
from tutorial_lines_rpc_pipeline_resnet import RPC_PIPELINE_RESNET_NAMES, RPC_PIPELINE_RESNET_TUTORIAL
from tutorial_lines_rpc_start import RPC_RL_NAMES, RPC_RL_TUTORIAL, RPC_RNN_NAMES, RPC_RNN_TUTORIAL

pytestmark = pytest.mark.fast

EXAMPLES = ["rpc_rl", "ddp_rpc", "rpc_rnn", "rpc_pipeline_resnet", "pipelining_transformer"]
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
    """rpc_pipeline_resnet's bridge (on its docs page, one link from the README): each RPC idea
    and its pipelining counterpart, both linked."""
    readme = REPO / "docs" / "rpc_pipeline_resnet.md"
    rows = map_rows(readme, BRIDGE)
    files = {Path(rel).name for _, rel, _ in rows}
    assert {"main.py", "model.py", "pipelining.py"} <= files and len(rows) >= 16, rows
    assert not problems(readme, BRIDGE), "\n".join(problems(readme, BRIDGE))


TODAY = "## The same model today"


@pytest.mark.parametrize("example", ["ddp_rpc", "rpc_rnn"])
def test_every_rpc_piece_and_what_replaced_it_are_on_their_lines(example):
    """The bridge from each RPC piece to its DTensor counterpart in sharded.py, both linked (on
    the example's docs page; the README's "The same model today" is short and links to it)."""
    readme = REPO / "docs" / f"{example}.md"
    rows = map_rows(readme, TODAY)
    assert "sharded.py" in {Path(rel).name for _, rel, _ in rows} and len(rows) >= 16, rows
    assert not problems(readme, TODAY), "\n".join(problems(readme, TODAY))


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


# the repository's own pages: not .pytest_cache/README.md, which a second run would add
MARKDOWN = sorted(p for p in {*REPO.glob("*.md"), *REPO.glob("*/README.md"), *REPO.glob("docs/**/*.md")}
                  if not p.relative_to(REPO).parts[0].startswith("."))


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



# every tutorial's lines and names, as data: tests/tutorial_lines_*.py
TUTORIAL_LINES = {"pipelining_transformer": PIPELINING_TUTORIAL, "ddp_rpc": DDP_RPC_TUTORIAL,
                  "rpc_rl": RPC_RL_TUTORIAL, "rpc_rnn": RPC_RNN_TUTORIAL,
                  "rpc_pipeline_resnet": RPC_PIPELINE_RESNET_TUTORIAL}


def differences(readme: Path) -> list[str]:
    """The "What differs" sections of an example: its README's, and its docs page's, where the
    differences a learner would not trip over are told (``docs/<example>.md``)."""
    pages = [readme, readme.parent.parent / "docs" / f"{readme.parent.name}.md"]
    texts = [page.read_text() for page in pages if page.is_file()]
    return [text.split(DIFFERS, 1)[1].split("\n## ", 1)[0] for text in texts if DIFFERS in text]


def uncovered(readme: Path, lines: list[tuple[str, str]]) -> list[str]:
    """The tutorial lines whose covering text is in neither the step map nor "What differs"."""
    text = readme.read_text()
    sections = [text.split(HEADING, 1)[1].split("\n## ", 1)[0]] if HEADING in text else []
    flat = " ".join(" ".join(s.split()) for s in sections + differences(readme))  # prose wraps: word by word
    return [line for line, cover in lines if " ".join(cover.split()) not in flat]


@pytest.mark.parametrize("example", sorted(TUTORIAL_LINES))
def test_every_tutorial_line_has_a_row_or_a_difference(example):
    missing = uncovered(REPO / example / "README.md", TUTORIAL_LINES[example])
    assert not missing, "tutorial lines with no map row and no 'What differs' line:\n" + "\n".join(missing)


def test_a_tutorial_line_without_a_row_fails(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{HEADING}\n\n| step | code | where |\n|---|---|---|\n"
                      "| Step 2: `num_microbatches = 4` | `4` | [main.py#L1](main.py#L1) |\n\n"
                      f"{DIFFERS}\n\n- **`RANK`, not `LOCAL_RANK`**, is the\n  rank.\n")
    lines = [("num_microbatches = 4", "`num_microbatches = 4`"), ("rank = ...", "**`RANK`, not `LOCAL_RANK`**, is the rank"),
             ("model.to(device)", "`model.to(device)`")]
    assert uncovered(readme, lines) == ["model.to(device)"]


# The names a learner looks for, one list per tutorial (the four RPC tutorials' are in
# tests/tutorial_lines_*.py). An entry is the tutorial's own text: "def name(params)" (a
# method as "def Class.name(params)"), "class Name(bases)", "name = value", or a pair
# (expression, the name "What differs" gives it).
TUTORIAL_NAMES = {"pipelining_transformer": PIPELINING_NAMES, "ddp_rpc": DDP_RPC_NAMES,
                  "rpc_rl": RPC_RL_NAMES, "rpc_rnn": RPC_RNN_NAMES,
                  "rpc_pipeline_resnet": RPC_PIPELINE_RESNET_NAMES}


def tutorial_name(entry: str | tuple[str, str]) -> tuple[str, object, str]:
    """(kind, shape, name) of a names entry: the shape the code must have, and the name that
    "What differs" must give in backticks if it does not (a method: ``Class.name``, a
    constructor: ``Class``)."""
    text, name = entry if isinstance(entry, tuple) else (entry, None)
    if text.startswith("def "):
        qualified, _, rest = text[4:].partition("(")
        cls, _, fn = qualified.rpartition(".")
        params = ast.parse(f"def {fn}({rest}: pass").body[0].args
        return "def", (cls, fn, params), name or (cls if fn == "__init__" else qualified)
    if text.startswith("class "):
        node = ast.parse(f"{text}: pass").body[0]
        return "class", (node.name, tuple(ast.unparse(b) for b in node.bases)), name or node.name
    node = ast.parse(text).body[0]
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        target = ast.unparse(node.targets[0] if isinstance(node, ast.Assign) else node.target)
        return "value", (target, ast.unparse(node.value)), name or target
    assert name is not None, f"{text!r}: give an expression the name 'What differs' uses: (text, name)"
    return "expr", ast.unparse(node.value), name


def code_shapes(files: list[Path]) -> tuple[dict[tuple[str, str], list[ast.arguments]], set]:
    """What ``files`` hold: every function's parameters by (class or "", name), and a set of
    (kind, shape): classes with their bases, values given to a name (``name = value``, a
    keyword ``name=value``, a flag ``--name`` with ``default=value``) and every expression."""
    defs: dict[tuple[str, str], list[ast.arguments]] = defaultdict(list)
    found: set = set()
    for path in files:
        tree = ast.parse(path.read_text())
        methods = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                found.add(("class", (node.name, tuple(ast.unparse(b) for b in node.bases))))
                for child in node.body:
                    if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        defs[node.name, child.name].append(child.args)
                        methods.add(child)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node not in methods:
                defs["", node.name].append(node.args)
            elif isinstance(node, ast.Assign):
                found.update(("value", (ast.unparse(t), ast.unparse(node.value))) for t in node.targets)
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                found.add(("value", (ast.unparse(node.target), ast.unparse(node.value))))
            elif isinstance(node, ast.keyword) and node.arg is not None:
                found.add(("value", (node.arg, ast.unparse(node.value))))
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "add_argument" and node.args
                    and isinstance(flag := node.args[0], ast.Constant) and str(flag.value).startswith("--")):
                found.update(("value", (flag.value[2:], ast.unparse(k.value)))
                             for k in node.keywords if k.arg == "default")
            if isinstance(node, ast.expr):
                found.add(("expr", ast.unparse(node)))
    return defs, found


def fits(tutorial: ast.arguments, ours: ast.arguments) -> bool:
    """Whether ``ours`` has the tutorial's parameters: its names in its order with its defaults
    (annotations aside); anything added comes after them and has a default, so a call written
    as in the tutorial still works (and nothing is added before its ``*args``, which would
    take the tutorial's extra arguments)."""
    def positional(a: ast.arguments) -> list[tuple[str, str | None]]:
        names = [p.arg for p in (*a.posonlyargs, *a.args)]
        return list(zip(names, [None] * (len(names) - len(a.defaults)) + [ast.unparse(d) for d in a.defaults]))

    def keyword_only(a: ast.arguments) -> dict[str, str | None]:
        return {p.arg: None if d is None else ast.unparse(d) for p, d in zip(a.kwonlyargs, a.kw_defaults)}

    theirs, mine = positional(tutorial), positional(ours)
    added = mine[len(theirs):]
    if mine[:len(theirs)] != theirs or any(d is None for _, d in added):
        return False
    if tutorial.vararg and (added or not ours.vararg or ours.vararg.arg != tutorial.vararg.arg):
        return False
    if tutorial.kwarg and (not ours.kwarg or ours.kwarg.arg != tutorial.kwarg.arg):
        return False
    their_kw, my_kw = keyword_only(tutorial), keyword_only(ours)
    return (all(k in my_kw and my_kw[k] == d for k, d in their_kw.items())
            and all(d is not None for k, d in my_kw.items() if k not in their_kw))


def name_problems(readme: Path, names: list) -> list[str]:
    """The tutorial names that the code the step map links holds in another shape (renamed,
    other parameters or values) while "What differs" never names them in backticks."""
    files = sorted({readme.parent / rel for _, rel, _ in map_rows(readme)})
    defs, found = code_shapes(files)
    spans = NAME.findall("\n".join(differences(readme)))
    problems = []
    for entry in names:
        kind, shape, name = tutorial_name(entry)
        if kind == "def":
            cls, fn, params = shape
            in_code = any(fits(params, ours) for ours in defs.get((cls, fn), []))
        else:
            in_code = (kind, shape) in found
        named = any(re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", span) for span in spans)
        if not in_code and not named:
            problems.append(f"{entry[0] if isinstance(entry, tuple) else entry}: not so in "
                            f"{', '.join(f.name for f in files)}, and 'What differs' names no `{name}`")
    return problems


@pytest.mark.parametrize("example", sorted(TUTORIAL_NAMES))
def test_every_tutorial_name_is_in_the_code_or_named_in_what_differs(example):
    missing = name_problems(REPO / example / "README.md", TUTORIAL_NAMES[example])
    assert not missing, "tutorial names renamed or reshaped with no 'What differs' line:\n" + "\n".join(missing)


def test_a_renamed_function_without_a_difference_fails(tmp_path):
    (tmp_path / "main.py").write_text(
        "NUM = 4\n\n\ndef train(model: object, steps: int = 1) -> None:\n    pass\n\n\n"
        "def run_worker(rank, args):\n    pass\n")
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{HEADING}\n\n| step | code | where |\n|---|---|---|\n"
                      "| loop | `train` | [main.py#L4](main.py#L4) |\n\n"
                      f"{DIFFERS}\n\n- **`distkit.start_rank`** sets each rank up.\n")
    names = ["NUM = 4", "def train(model)", "def run_worker(rank, world_size)", "NUM = 8"]
    assert name_problems(readme, names) == [
        "def run_worker(rank, world_size): not so in main.py, and 'What differs' names no `run_worker`",
        "NUM = 8: not so in main.py, and 'What differs' names no `NUM`",
    ]
    readme.write_text(readme.read_text() + "- **`run_worker(rank, args)`**, not `run_worker(rank, world_size)`.\n"
                      "- `NUM` is 4.\n")
    assert name_problems(readme, names) == []


def test_a_difference_told_on_the_docs_page_covers_a_tutorial_line(tmp_path):
    """A difference moved from the README to ``docs/<example>.md``'s "What differs" still covers its line."""
    readme = tmp_path / "ex" / "README.md"
    readme.parent.mkdir()
    (tmp_path / "docs").mkdir()
    readme.write_text(f"# x\n\n{HEADING}\n\n| step | code | where |\n|---|---|---|\n\n{DIFFERS}\n\n- nothing\n")
    lines = [("model.to(device)", "`model.to(device)`")]
    assert uncovered(readme, lines) == ["model.to(device)"]
    (tmp_path / "docs" / "ex.md").write_text(f"# ex\n\n{DIFFERS}\n\n- **`model.to(device)`** moves it.\n\n## Next\n")
    assert uncovered(readme, lines) == []


# ---- every launch is the tutorial's: mp.spawn(run_worker, ..., join=True), or run_worker under torchrun ----

# every program that launches ranks: the five main.py and the four beside them
LAUNCH_SITES = ["rpc_rl/main.py", "ddp_rpc/main.py", "ddp_rpc/sharded.py", "rpc_rnn/main.py", "rpc_rnn/sharded.py",
                "rpc_pipeline_resnet/main.py", "rpc_pipeline_resnet/pipelining.py",
                "pipelining_transformer/main.py", "pipelining_transformer/train.py"]
GONE_FLAGS = ("--ranks", "--master_addr", "--master_port")  # several machines are torchrun's
GONE_NAMES = {"Job", "wrap"}  # the launcher that wrapped the tutorial's spawn


def _dotted(node: ast.expr) -> str:
    """``a.b.c`` for a name or an attribute chain, else ""."""
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}" if _dotted(node.value) else ""
    return node.id if isinstance(node, ast.Name) else ""


def _distkit_names(tree: ast.Module) -> set[str]:
    """The names this module reaches distkit by: ``distkit``, and what it imports from it."""
    names = {"distkit"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "distkit":
            names.update(a.asname or a.name for a in node.names)
    return names


def init_process_group_problems(path: Path) -> list[str]:
    """The ``init_process_group`` calls of ``path`` that hold a distkit value in their arguments: a
    value the tutorial's call takes is computed in sight, on a line above it."""
    tree = ast.parse(path.read_text())
    ours = _distkit_names(tree)
    found = []
    for call in ast.walk(tree):
        if isinstance(call, ast.Call) and _dotted(call.func).split(".")[-1] == "init_process_group":
            for arg in [*call.args, *(k.value for k in call.keywords)]:
                used = sorted({_dotted(n) for n in ast.walk(arg) if isinstance(n, (ast.Name, ast.Attribute))
                               and _dotted(n).split(".")[0] in ours})
                used = [u for u in used if not any(v.startswith(f"{u}.") for v in used)]  # the whole chain
                if used:
                    found.append(f"{path.name}:{call.lineno}: init_process_group's arguments hold "
                                 f"{', '.join(used)}: compute it on the line above")
    return found


def launch_problems(path: Path) -> list[str]:
    """Why ``path`` does not launch as its tutorial does (empty: it does). Its ``run_worker(rank, args)``
    opens with ``distkit.start_rank(rank, args)``; its one ``mp.spawn`` passes ``run_worker`` itself,
    with ``join=True``; torchrun's process runs ``record(run_worker)``; ``run_worker`` is handed to
    nothing else; no ``Job``, ``wrap`` or ``join=False``; no flag of the launcher that spread ranks
    over machines; no distkit value inside an ``init_process_group`` call."""
    tree = ast.parse(path.read_text())
    found = []
    worker = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "run_worker"), None)
    if worker is None:
        return [f"{path.name}: no module-level run_worker"]
    params = [a.arg for a in worker.args.args]
    if params[:2] != ["rank", "args"]:
        found.append(f"{path.name}: run_worker({', '.join(params)}), not run_worker(rank, args)")
    body = worker.body[1:] if ast.get_docstring(worker) is not None else worker.body
    first = body[0] if body else None
    if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Call)
            and _dotted(first.value.func) == "distkit.start_rank"
            and [ast.unparse(a) for a in first.value.args] == ["rank", "args"]):
        found.append(f"{path.name}:{worker.lineno}: run_worker's first statement is not "
                     f"distkit.start_rank(rank, args): {ast.unparse(first) if first else 'none'}")
    spawns = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and _dotted(n.func) in ("mp.spawn", "spawn")]
    if len(spawns) != 1:
        found.append(f"{path.name}: {len(spawns)} mp.spawn calls, not one")
    handed = set()  # the nodes where run_worker is passed on as the tutorial passes it
    for spawn in spawns:
        join = {k.arg: k.value for k in spawn.keywords}.get("join")
        if not (spawn.args and _dotted(spawn.args[0]) == "run_worker"):
            found.append(f"{path.name}:{spawn.lineno}: {ast.unparse(spawn)} does not spawn run_worker itself")
        else:
            handed.add(spawn.args[0])
        if not (isinstance(join, ast.Constant) and join.value is True):
            found.append(f"{path.name}:{spawn.lineno}: {ast.unparse(spawn)} without join=True")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Call) and _dotted(node.func.func) == "record"
                and [_dotted(a) for a in node.func.args] == ["run_worker"]):
            handed.add(node.func.args[0])
    if not any(isinstance(n, ast.Call) and isinstance(n.func, ast.Call) and n.func.args
               and n.func.args[0] in handed for n in ast.walk(tree)):
        found.append(f"{path.name}: no record(run_worker)(...) for a process torchrun started")
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == "run_worker" and node not in handed:
            found.append(f"{path.name}:{node.lineno}: run_worker neither spawned nor run under record here")
        if (isinstance(node, ast.Name) and node.id in GONE_NAMES) or (
                isinstance(node, ast.Attribute) and node.attr in GONE_NAMES):
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.keyword) and node.arg == "join" and not (
                isinstance(node.value, ast.Constant) and node.value.value is True):
            found.append(f"{path.name}:{node.value.lineno}: join={ast.unparse(node.value)}")
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith(GONE_FLAGS):
            found.append(f"{path.name}:{node.lineno}: the flag {node.value}: several machines are torchrun's")
    return found + init_process_group_problems(path)


@pytest.mark.parametrize("site", LAUNCH_SITES)
def test_every_launch_is_the_tutorials_spawn_or_torchrun(site):
    assert not launch_problems(REPO / site), "\n".join(launch_problems(REPO / site))


@pytest.mark.parametrize("site", LAUNCH_SITES)
def test_no_launch_site_has_a_flag_of_the_launcher_over_machines(site):
    """The parser as a user meets it, shared flags included: none of them, nor a flag that argparse
    would take for one of them abbreviated."""
    module = importlib.import_module(site.removesuffix(".py").replace("/", "."))
    flags = [f for f in module.build_parser()._option_string_actions if f.startswith(GONE_FLAGS)]
    assert not flags, flags


EXAMPLE_SOURCES = sorted(p for e in EXAMPLES for p in (REPO / e).glob("*.py"))


@pytest.mark.parametrize("source", EXAMPLE_SOURCES, ids=[str(p.relative_to(REPO)) for p in EXAMPLE_SOURCES])
def test_no_distkit_value_inside_an_init_process_group_call(source):
    assert not init_process_group_problems(source), "\n".join(init_process_group_problems(source))


WRAPPED_LAUNCH = """
import argparse
import distkit
import torch.distributed as dist
import torch.multiprocessing as mp


def run_worker(rank: int, args: argparse.Namespace) -> None:
    \"\"\"Doc.\"\"\"
    distkit.start_rank(rank, args)
    dist.init_process_group(backend="gloo", rank=rank, world_size=args.world_size)


def main() -> None:
    parser = distkit.ArgumentParser()
    args = parser.parse_args()
    if distkit.under_torchrun():
        record(run_worker)(0, args)
    else:
        mp.spawn(run_worker, args=(args,), nprocs=args.world_size, join=True)
"""


def test_a_launch_wrapped_as_before_fails(tmp_path):
    """The check itself can fail: the tutorial's launch passes, and each piece of the launcher that
    wrapped it is found."""
    site = tmp_path / "main.py"
    site.write_text(WRAPPED_LAUNCH)
    assert launch_problems(site) == []
    site.write_text(WRAPPED_LAUNCH.replace(
        "mp.spawn(run_worker, args=(args,), nprocs=args.world_size, join=True)",
        "job.join(mp.spawn(job.wrap(run_worker), args=(args,), nprocs=args.world_size, join=False))").replace(
        'backend="gloo"', "backend=distkit.agreed_backend(rank)").replace(
        "    distkit.start_rank(rank, args)\n", "").replace(
        "    args = parser.parse_args()", '    parser.add_argument("--master_addr")\n    args = parser.parse_args()'))
    spawn = "mp.spawn(job.wrap(run_worker), args=(args,), nprocs=args.world_size, join=False)"
    assert launch_problems(site) == [
        "main.py:8: run_worker's first statement is not distkit.start_rank(rank, args): "
        "dist.init_process_group(backend=distkit.agreed_backend(rank), rank=rank, world_size=args.world_size)",
        f"main.py:20: {spawn} does not spawn run_worker itself",
        f"main.py:20: {spawn} without join=True",
        "main.py:15: the flag --master_addr: several machines are torchrun's",
        "main.py:20: join=False",
        "main.py:20: job.wrap",
        "main.py:20: run_worker neither spawned nor run under record here",
        "main.py:10: init_process_group's arguments hold distkit.agreed_backend: compute it on the line above",
    ]
