"""What a page shows, a run printed (scripts/pages.py): every output block's command re-run and compared with
the block; every generated part as the generator wrote it (its checksum) and fresh (its fingerprint: the
code it ran, unchanged since); no measured figure outside a generated part; no page command that writes a
tracked file."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
import pages  # noqa: E402

PAGES = [REPO / "README.md", *sorted(REPO.glob("*/README.md")), *sorted((REPO / "docs").glob("*.md"))]
PAGES = [p for p in PAGES if ".venv" not in p.parts]
PARTS = [(md, part) for md in pages.pages() for part in pages.parts(md)]
OUTPUTS = [(md, part) for md, part in PARTS if part["call"] == "pages.output"]


def _id(md, part) -> str:
    return f"{md.relative_to(REPO)}:{part['line']}"


def block_lines(part: dict) -> tuple[str, list[str]]:
    """An output part's command and the lines it shows (between ``$ command`` and the fence)."""
    lines = part["text"].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("$ "))
    end = lines.index("```", start)
    return lines[start][2:], lines[start + 1:end]


# ---- the output blocks, re-run ----

@pytest.mark.timeout(600)
@pytest.mark.parametrize("md, part", OUTPUTS, ids=[_id(*p) for p in OUTPUTS])
def test_every_output_block_prints_what_it_shows(md, part):
    """The block's command, run now from the repo's root, prints what the block shows: each rank's lines
    in order, a time any time, a decimal number within the block's ``units`` of its last digit
    (``pages.same``)."""
    example, command = part["args"][:2]
    kw = {"head": 1, "tail": 1, "units": pages.UNITS} | part["kwargs"]
    shown_command, block = block_lines(part)
    assert shown_command == command
    printed = pages.shown(pages.run(command, timeout=kw.get("timeout", 300)).splitlines(), kw["head"], kw["tail"])
    problems = pages.same(block, printed, kw["units"])
    assert not problems, (f"{_id(md, part)} shows what `{command}` no longer prints; refresh with "
                          f"{pages.refresh_command(md, example)}:\n" + "\n".join(problems))


def _changed_digit(line: str) -> str:
    """``line`` with the last digit but one of its first decimal number (not a time) one higher: ten units
    of its last digit."""
    for m in pages.NUMBER.finditer(pages.TIME.sub(lambda t: "T" * len(t.group()), line)):
        if "." in m.group() and "e" not in m.group() and len(m.group().partition(".")[2]) >= 2:
            i = m.end() - 2
            return line[:i] + str((int(line[i]) + 1) % 10) + line[i + 1:]
    return line


@pytest.mark.fast
@pytest.mark.parametrize("md, part", OUTPUTS, ids=[_id(*p) for p in OUTPUTS])
def test_a_block_with_one_loss_off_by_a_digit_fails(md, part):
    """Each block's own comparison catches one of its numbers changed in one digit (its last but one)."""
    units = part["kwargs"].get("units", pages.UNITS)
    _, block = block_lines(part)
    assert not pages.same(block, block, units)
    changed = [i for i, line in enumerate(block) if _changed_digit(line) != line]
    assert changed, f"{_id(md, part)}: no decimal number to compare"
    for i in changed:
        edited = [*block[:i], _changed_digit(block[i]), *block[i + 1:]]
        assert pages.same(edited, block, units), edited[i]


@pytest.mark.fast
def test_the_comparison_of_a_block_and_a_run():
    block = ["[rank 0] loss 2.1050 (0.59 s)", "[rank 1] epoch 0 loss 1.0000", "[rank 1] ...", "done in 3.1 s"]
    run = ["[rank 1] epoch 0 loss 1.0002", "[rank 0] loss 2.1048 (7.20 s)", "[rank 1] x", "[rank 1] y",
           "done in 12 s"]
    assert pages.shown(run, 1, 0) == ["[rank 1] epoch 0 loss 1.0002", "[rank 0] loss 2.1048 (7.20 s)",
                                      "[rank 1] ...", "done in 12 s"]
    assert pages.same(block, pages.shown(run, 1, 0)) == []  # interleaving, times, two units of the last digit
    assert pages.same(["[rank 1] loss 1.0000"], ["[rank 1] loss 1.0003"])  # three units
    assert pages.same(["[rank 1] epoch 1 loss 1.0"], ["[rank 1] epoch 2 loss 1.0"])  # an integer
    assert pages.same(["a 1.0"], ["a 1.0 b"])  # the text
    assert pages.same(["[rank 1] a"], ["[rank 1] a", "[rank 1] b"])  # a line more
    assert pages._unit("0.0554") == pytest.approx(1e-4) and pages._unit("50.441134462368865") == pytest.approx(1e-15)


# ---- the parts as generated, and fresh ----

@pytest.mark.fast
@pytest.mark.parametrize("md", pages.pages(), ids=[str(m.relative_to(REPO)) for m in pages.pages()])
def test_every_part_is_as_the_generator_wrote_it(md):
    """Each part carries cog's checksum of its text (a hand edit breaks it) and its hidden line; the page's
    last part names its sitting."""
    found = pages.parts(md)
    for part in found:
        assert part["sum"] == part["digest"], f"{_id(md, part)} was edited by hand: {pages.refresh_command(md)}"
        if part["call"] != "pages.sitting_line":
            assert part["meta"], f"{_id(md, part)} was never generated: {pages.refresh_command(md)}"
    assert found[-1]["call"] == "pages.sitting_line" and "pages.py" in found[-1]["text"], md


@pytest.mark.fast
@pytest.mark.parametrize("md, part", PARTS, ids=[_id(*p) for p in PARTS])
def test_every_part_is_fresh(md, part):
    """A part's fingerprint is that of the code it ran, as it is now, and of the torch installed: no figure
    outlives the code that produced it. The GPU part alone may say it was not re-run since."""
    import torch

    meta = part["meta"]
    if meta is None:
        return
    if meta.get("gpu"):
        now = pages.fingerprint(meta["sources"], meta["torch"])
        assert now == meta["fingerprint"] or pages.NOT_RERUN in part["text"], (
            f"{_id(md, part)}: the GPU part must say '{pages.NOT_RERUN}': {pages.refresh_command(md, 'gpu')}")
        return
    now = pages.fingerprint(meta["sources"], torch.__version__)
    assert now == meta["fingerprint"], (
        f"{_id(md, part)} came from other code ({', '.join(meta['sources'])}) or another torch than "
        f"{torch.__version__}: refresh it with {pages.refresh_command(md, meta['example'])}")


@pytest.mark.fast
def test_a_change_of_code_makes_a_part_stale_and_a_comment_does_not(tmp_path):
    shutil.copytree(REPO / "rpc_rnn", tmp_path / "rpc_rnn", ignore=shutil.ignore_patterns("__pycache__"))
    before = pages.fingerprint(["rpc_rnn"], "2.14.1", root=tmp_path)
    main = tmp_path / "rpc_rnn" / "main.py"
    text = main.read_text()
    main.write_text(text.replace('"""', '"""A changed docstring. ', 1) + "\n# a comment\n\n")
    assert pages.fingerprint(["rpc_rnn"], "2.14.1", root=tmp_path) == before
    assert pages.fingerprint(["rpc_rnn"], "2.15.0", root=tmp_path) != before
    main.write_text(text + "\nx = 1\n")
    assert pages.fingerprint(["rpc_rnn"], "2.14.1", root=tmp_path) != before


# ---- figures only where generated ----

FIGURE = re.compile(r"\b\d(?:[\d,.]*\d)?(?:\s?(?:s|ms|min|minutes|seconds|hours?|B|KB|MB|GB|KiB|MiB|GiB|%)|x|×)(?!\w)|"
                    r"\b\d(?:[\d,.]*\d)?\s?(?:it|steps|iterations|episodes|images)(?:/s| a second| per second)\b")
# a configured value, not a measured one: a flag's default, a timeout, a grace, a bound, a sleep
CONFIGURED = re.compile(r"timeout|grace|bound|default|--\w+|sleep|wait|after|every|limit|margin|interval|"
                        r"at most|up to|tolerance|within", re.I)
PART_SPAN = re.compile(r"^[^\n]*\[\[\[cog.*?\[\[\[end\]\]\][^\n]*$", re.M | re.S)


def measured_figures(text: str) -> list[str]:
    """The measured figures of a page outside its generated parts and HTML comments, each with its
    paragraph; a figure with a word of configuration in the 60 characters before it is configured."""
    text = re.sub(r"<!--.*?-->", "", PART_SPAN.sub("", text), flags=re.S)
    found = []
    for paragraph in re.split(r"\n\s*\n|\n(?=\|)", text):
        flat = " ".join(paragraph.split())
        for m in FIGURE.finditer(flat):
            if not CONFIGURED.search(flat[max(0, m.start() - 60):m.start()]):
                found.append(f"{m.group()!r} in: {flat[max(0, m.start() - 60):m.end() + 20]}")
    return found


@pytest.mark.fast
@pytest.mark.parametrize("md", PAGES, ids=[str(m.relative_to(REPO)) for m in PAGES])
def test_no_measured_figure_outside_a_generated_part(md):
    assert not measured_figures(md.read_text()), "\n".join(measured_figures(md.read_text()))


@pytest.mark.fast
def test_a_typed_figure_is_found():
    page = ("It ran in 2.2 s.\n| a | 15 % |\n--hang_timeout 30 s, a timeout of 30 s\n128x128 images\n"
            "<!-- [[[cog pages.x() ]]] -->\nIt took 3.0 s\n<!-- [[[end]]] (sum: x) -->\n<!-- 4 s -->\n")
    assert [f.split(" in: ")[0] for f in measured_figures(page)] == ["'2.2 s'", "'15 %'"]


# ---- nothing a page shows writes into a tracked file ----

WRITES = re.compile(r"(?:--(?:plot|out|save|trace|checkpoint|record|junitxml)[= ]|>\s*)(\S+)")


def page_commands() -> list[tuple[str, str]]:
    """Each command a page shows in a shell block (```bash), with its page."""
    found = []
    for md in PAGES:
        for block in re.findall(r"```(?:bash|sh|console)\n(.*?)```", md.read_text(), re.S):
            found += [(str(md.relative_to(REPO)), line.split(" #")[0].strip())
                      for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return found


def tracked(path: str) -> bool:
    """Would git track a file written at ``path`` (from the repo's root)? Outside the checkout: no."""
    target = (REPO / path).resolve()
    if REPO not in target.parents:
        return False
    ignored = subprocess.run(["git", "-C", str(REPO), "check-ignore", "-q", "--no-index", str(target)])
    return ignored.returncode != 0


@pytest.mark.fast
def test_no_page_command_writes_a_tracked_file():
    written = [(page, command) for page, command in page_commands()
               for path in WRITES.findall(command) if not path.startswith(("$", "/dev/", "&")) and tracked(path)]
    assert not written, "\n".join(f"{p}: {c}" for p, c in written)
    assert tracked("docs/results/x.png") and not tracked("results/x.png") and not tracked("/tmp/x.png")


@pytest.mark.fast
def test_no_script_writes_into_the_checkout_by_default():
    """Each script's output flags default to the git-ignored results/ folder (or to nothing): only the
    generator, scripts/pages.py, writes into docs/."""
    for script in sorted((REPO / "scripts").glob("*.py")):
        text = script.read_text()
        for flag, default in re.findall(r'add_argument\("--(plot|out|record|save)".*?default=([^,)]+\)?)', text, re.S):
            name = re.fullmatch(r"str\((\w+)\)|(\w+)", default.strip())
            if name and name.group(name.lastindex) != "None":  # a constant: its value, as the script sets it
                default = re.search(rf"^{name.group(name.lastindex)} = ([^#\n]*)", text, re.M).group(1)
            assert default.strip() == "None" or "results" in default and "docs" not in default, (script, flag)
