"""The pages read as lessons: the README a landing page, each example README a tutorial part's
length in the tutorial's order, tests named only in the closing list, a picture that exists, and
no page about how the project was built."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import DIFFERS, HEADING, REPO
from test_tutorial_maps import MARKDOWN

pytestmark = pytest.mark.fast

EXAMPLES = ["rpc_rl", "ddp_rpc", "rpc_rnn", "rpc_pipeline_resnet", "pipelining_transformer"]
TESTED = "## How this is tested"
MAX_WORDS = 1500  # a tutorial part runs 733 to 1,541 words
# the sections a lesson has, in this order (others may stand between them)
ORDER = ["## Run it", "## What you see", HEADING, DIFFERS, TESTED]
TEST_NAME = re.compile(r"\btest_\w+|\btests/|\bconftest\b|\bCI\b|\bpytest\b")
PICTURE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)|<img [^>]*src=\"([^\"]+)\"")


def sections(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("## ")]


def lesson_problems(readme: Path) -> list[str]:
    """What keeps an example README from reading as a lesson (empty: nothing)."""
    text = readme.read_text()
    found = []
    if (words := len(text.split())) > MAX_WORDS:
        found.append(f"{words} words, more than {MAX_WORDS}")
    heads = sections(text)
    missing = [h for h in ORDER if h not in heads]
    if missing:
        found.append(f"no section {missing}")
    elif [h for h in heads if h in ORDER] != ORDER:
        found.append(f"sections out of order: {heads}")
    elif heads[-1] != TESTED:
        found.append(f"{TESTED!r} is not the last section: {heads}")
    learner = text.split(TESTED, 1)[0]
    found += [f"names a test outside {TESTED!r}: {line.strip()!r}"
              for line in learner.splitlines() if TEST_NAME.search(line)]
    pictures = [a or b for a, b in PICTURE.findall(text)]
    if not pictures:
        found.append("embeds no picture")
    found += [f"picture {p} does not exist" for p in pictures if not (readme.parent / p).is_file()]
    return found


@pytest.mark.parametrize("example", EXAMPLES)
def test_every_example_readme_reads_as_a_lesson(example):
    problems = lesson_problems(REPO / example / "README.md")
    assert not problems, "\n".join(problems)


def test_a_readme_that_is_no_lesson_fails(tmp_path):
    readme = tmp_path / "README.md"
    body = "\n\n".join(["# x", "## Run it", "## What you see", "![loss](loss.png)", HEADING, DIFFERS,
                        "- `test_x` proves it", TESTED, "- `test_x`"])
    readme.write_text(body)
    (tmp_path / "loss.png").write_bytes(b"png")
    assert lesson_problems(readme) == ["names a test outside '## How this is tested': '- `test_x` proves it'"]
    readme.write_text(body.replace("- `test_x` proves it", "word " * MAX_WORDS).replace("loss.png", "gone.png")
                      .replace(f"{TESTED}\n\n- `test_x`", f"{TESTED}\n\n## More"))
    assert lesson_problems(readme) == [f"{MAX_WORDS + 31} words, more than {MAX_WORDS}",
                                       f"{TESTED!r} is not the last section: " + str(sections(readme.read_text())),
                                       "picture gone.png does not exist"]


def landing_problems(readme: Path) -> list[str]:
    """The README's first screen is for learners: up to the end of the examples table, no test,
    CI or timing under load; the whole at most about 120 lines; RPC's maintenance mode said."""
    text = readme.read_text()
    found = []
    if (n := len(text.splitlines())) > 125:
        found.append(f"{n} lines, more than about 120")
    first = text[:text.index("## The examples")] + text[text.index("## The examples"):].split("\n## ", 1)[0]
    found += [f"the first screen names a test or CI: {line.strip()!r}"
              for line in first.splitlines() if TEST_NAME.search(line) or "under load" in line or "busy" in line]
    if "maintenance mode" not in first:
        found.append("the first screen does not say that torch.distributed.rpc is in maintenance mode")
    return found


def test_the_readme_is_a_landing_page():
    problems = landing_problems(REPO / "README.md")
    assert not problems, "\n".join(problems)


def test_the_contributors_page_is_linked_once_from_the_readme():
    text = (REPO / "README.md").read_text()
    assert (REPO / "CONTRIBUTING.md").is_file()
    assert text.count("(CONTRIBUTING.md") == 1, "link the contributors' page once"


# how the project was made: no page tells it (git keeps the history)
DIARY = re.compile(r"\b[Ss]ession \d+|\bsession's\b|\b[Ii]ssue \d+|\bissue #?\d+|working day|"
                   r"\bwas measured by\b|\bin this session\b", re.I)


@pytest.mark.parametrize("md", MARKDOWN, ids=[str(m.relative_to(REPO)) for m in MARKDOWN])
def test_no_page_tells_how_the_project_was_built(md):
    lines = [line.strip() for line in md.read_text().splitlines() if DIARY.search(line)]
    assert not lines, "\n".join(lines)


@pytest.mark.parametrize("md", MARKDOWN, ids=[str(m.relative_to(REPO)) for m in MARKDOWN])
def test_a_page_that_names_examples_1385_says_what_it_breaks(md):
    """pytorch/examples#1385 stepped a local SGD after dist_autograd.backward: the gradients are in
    the distributed autograd context, not in .grad, so nothing trains. A page that names it warns."""
    paragraphs = [p for p in md.read_text().split("\n\n") if "1385" in p]
    for paragraph in paragraphs:
        flat = " ".join(paragraph.split())
        assert re.search(r"changes? nothing|trains nothing|not in `\.grad`", flat), flat


LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(md: Path) -> set[str]:
    found, seen = set(), {}
    in_code = False
    for line in md.read_text().splitlines():
        in_code ^= line.startswith("```")
        if not in_code and (m := re.match(r"#+ (.*)", line)):
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def broken_links(md: Path) -> list[str]:
    """The links of ``md`` to a file of this repository that is not there, or to a heading that is not."""
    broken = []
    for target in LINK.findall(md.read_text()):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (md.parent / path).resolve() if path else md
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no such heading in {file.name}")
    return broken


@pytest.mark.parametrize("md", MARKDOWN, ids=[str(m.relative_to(REPO)) for m in MARKDOWN])
def test_every_link_between_pages_lands(md):
    assert not broken_links(md), "\n".join(broken_links(md))


def test_a_link_to_a_missing_heading_is_found(tmp_path):
    assert slug("Balanced stages (`--stage_layers auto`)") == "balanced-stages---stage_layers-auto"
    page = tmp_path / "a.md"
    page.write_text("# A\n\n## Two words\n\n[ok](#two-words) [no](#three) [gone](b.md) [web](https://x.org/#y)\n")
    assert broken_links(page) == ["#three: no such heading in a.md", "b.md: no such file"]


TEST_COUNT = re.compile(r"\b\d[\d,]* (?:tests|passed)\b")


def test_a_test_count_is_given_on_one_page_at_most():
    """The suite's size changes with every test: one page (docs/results.md) says it, the others link there."""
    pages = [str(md.relative_to(REPO)) for md in MARKDOWN if TEST_COUNT.search(md.read_text())]
    assert pages in ([], ["docs/results.md"]), pages
    assert TEST_COUNT.search("the whole suite, 568 tests, passed") and not TEST_COUNT.search("test_x passed")


DOCS = sorted((REPO / "docs").glob("*.md"))
MAX_DOC_WORDS = 5000


@pytest.mark.parametrize("md", DOCS, ids=[m.name for m in DOCS])
def test_every_docs_page_says_who_it_is_for_and_stays_short(md):
    """A docs page opens, under its title, with one sentence on who it is for; at most 5,000 words."""
    opening = md.read_text().split("\n\n")[1]
    assert opening.startswith("For "), opening
    assert len(md.read_text().split()) <= MAX_DOC_WORDS


def named_tests(text: str) -> set[str]:
    """The test functions a page names: ``test_x`` or ``test_x[param]`` in backticks (a module's stem,
    ``test_devices``, or a prefix, ``test_bad_input_*``, is no function)."""
    return {n for n in re.findall(r"`(test_\w+)", text)
            if not n.endswith("_") and not (REPO / "tests" / f"{n}.py").exists()}


@pytest.mark.parametrize("md", MARKDOWN, ids=[str(m.relative_to(REPO)) for m in MARKDOWN])
def test_every_test_a_page_names_exists(md):
    defined = {n for p in (REPO / "tests").glob("*.py") for n in re.findall(r"def (test_\w+)", p.read_text())}
    assert not named_tests(md.read_text()) - defined, named_tests(md.read_text()) - defined
    assert named_tests("`test_gone[x]`, `test_devices`, `test_bad_input_*`") == {"test_gone"}
