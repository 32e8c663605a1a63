"""Each example's main.py is its tutorial's program, small enough to read beside the tutorial.

What a learner opens to follow a main.py is the files of its package that main.py imports at module level
(followed through their own imports; distkit left out), counted in lines of code without blank lines,
comments or docstrings, as ``../shared/tools/tutorial_path.py`` counts them. pipelining_transformer's
main.py holds the tutorial alone: what goes beyond it (train.py) is named nowhere in it, and both
programs call ``schedule.step`` in at most two places.
"""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = pytest.mark.fast

EXAMPLES = ["rpc_rl", "rpc_rnn", "ddp_rpc", "rpc_pipeline_resnet", "pipelining_transformer"]
MAX_LINES = 250
# what pipelining_transformer/train.py adds, which main.py neither names nor offers as a flag
BEYOND = ("dp_size", "resume", "checkpoint", "stage_layout", "loss_log", "trace")


def code_lines(src: str) -> int:
    """Lines holding code: not blank, not only a comment, not a docstring."""
    docs = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                docs.update(range(first.lineno, first.end_lineno + 1))
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type not in skip:
            lines.update(n for n in range(tok.start[0], tok.end[0] + 1) if n not in docs)
    return len(lines)


def loaded(example: str) -> list[Path]:
    """The files of ``example`` that its main.py loads at module level, main.py included."""
    seen, todo = set(), [REPO / example / "main.py"]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for top in ast.parse(path.read_text()).body:
            for node in ast.walk(top) if isinstance(top, (ast.If, ast.Try)) else [top]:
                names = []
                if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == example:
                    names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names if a.name.split(".")[0] == example]
                for name in names:
                    file = REPO / (name.replace(".", "/") + ".py")
                    if file.exists() and file.name != "__init__.py":
                        todo.append(file)
    return sorted(seen)


@pytest.mark.parametrize("example", EXAMPLES)
def test_main_py_loads_at_most_250_lines_of_code(example):
    sizes = {p.name: code_lines(p.read_text()) for p in loaded(example)}
    assert sum(sizes.values()) <= MAX_LINES, f"{example}/main.py loads {sizes}"


def test_the_count_sees_imports_and_skips_comments():
    assert code_lines('"""doc"""\n\n# a comment\nx = 1  # why\ny = (1,\n     2)\n') == 3
    assert {p.name for p in loaded("pipelining_transformer")} == {"main.py", "model.py"}


def _names(src: str) -> set[str]:
    return {tok.string for tok in tokenize.generate_tokens(io.StringIO(src).readline) if tok.type == tokenize.NAME}


def _beyond(words: set[str]) -> set[str]:
    """The words named for train.py's additions ("trace" as a word: ``tracer_model_split`` is the tutorial's)."""
    return {w for w in words for b in BEYOND if b in w and (b != "trace" or "trace" in re.split(r"[_\W]", w))}


def test_pipelining_main_py_is_the_tutorial_alone():
    from pipelining_transformer.main import build_parser

    main_py = (REPO / "pipelining_transformer" / "main.py").read_text()
    assert not _beyond(_names(main_py)), _beyond(_names(main_py))
    flags = set(re.findall(r"--\w+", build_parser().format_help()))
    assert not _beyond(flags), _beyond(flags)
    train_py = (REPO / "pipelining_transformer" / "train.py").read_text()
    assert _beyond(_names(train_py)) and _beyond({"stage_layouts", "trace"}) == {"stage_layouts", "trace"}


def _schedule_steps(src: str) -> int:
    return sum(isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "step"
               and ast.unparse(node.func.value).endswith("schedule") for node in ast.walk(ast.parse(src)))


@pytest.mark.parametrize("program", ["main.py", "train.py"])
def test_schedule_step_is_called_in_at_most_two_places(program):
    src = (REPO / "pipelining_transformer" / program).read_text()
    assert _schedule_steps(src) <= 2
    assert _schedule_steps("pp.schedule.step(x)\nschedule.step()\nopt.step()") == 2
