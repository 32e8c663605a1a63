"""The pages read as lessons: the README a landing page, each example README shorter than a tutorial
part, in the tutorial's order, naming no test and ending with a link to its tests on the contributors'
page, a picture that exists; each measured figure on one page; no page about how the project was built."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from conftest import DIFFERS, HEADING, REPO
from test_tutorial_maps import MARKDOWN

pytestmark = pytest.mark.fast

EXAMPLES = ["rpc_rl", "ddp_rpc", "rpc_rnn", "rpc_pipeline_resnet", "pipelining_transformer"]
MAX_WORDS = 1100  # a tutorial part runs 733 to 1,541 words: the lesson beside it is shorter
MAX_README_WORDS = 1000
# the sections a lesson has, in this order (others may stand between them and after them)
ORDER = ["## Run it", "## What you see", HEADING, DIFFERS]
TEST_NAME = re.compile(r"\btest_\w+|\btests/|\bconftest\b|\bCI\b|\bpytest\b")


def last_line(example: str) -> str:
    """An example README's last line: where its tests are described, the one mention of them."""
    return f"How this example is tested: [CONTRIBUTING.md](../CONTRIBUTING.md#{example})."
PICTURE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)|<img [^>]*src=\"([^\"]+)\"")


def sections(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("## ")]


def lesson_problems(readme: Path) -> list[str]:
    """What keeps an example README from reading as a lesson (empty: nothing)."""
    text = readme.read_text()
    found = []
    if (words := word_count(text)) > MAX_WORDS:
        found.append(f"{words} words, more than {MAX_WORDS}")
    heads = sections(text)
    missing = [h for h in ORDER if h not in heads]
    if missing:
        found.append(f"no section {missing}")
    elif [h for h in heads if h in ORDER] != ORDER:
        found.append(f"sections out of order: {heads}")
    if text.strip().splitlines()[-1] != last_line(readme.parent.name):
        found.append(f"the last line is not {last_line(readme.parent.name)!r}")
    found += [f"names a test or tells how it was checked: {line.strip()!r}"
              for line in COMMENT.sub("", text).splitlines() if TEST_NAME.search(line) or CHECKED.search(line)]
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
    readme = tmp_path / "x" / "README.md"
    readme.parent.mkdir()
    body = "\n\n".join(["# x", "## Run it", "## What you see", "![loss](loss.png)", HEADING, DIFFERS,
                        "- `test_x` proves it", last_line("x")])
    readme.write_text(body)
    (readme.parent / "loss.png").write_bytes(b"png")
    assert lesson_problems(readme) == ["names a test or tells how it was checked: '- `test_x` proves it'"]
    readme.write_text(body.replace("- `test_x` proves it", "word " * MAX_WORDS).replace("loss.png", "gone.png")
                      .replace(last_line("x"), "## How this is tested"))
    assert lesson_problems(readme) == [f"{MAX_WORDS + 29} words, more than {MAX_WORDS}",
                                       f"the last line is not {last_line('x')!r}",
                                       "picture gone.png does not exist"]


def landing_problems(readme: Path) -> list[str]:
    """The README's first screen is for learners: up to the end of the examples table, no test,
    CI or timing under load; the whole at most about 120 lines; RPC's maintenance mode said."""
    text = readme.read_text()
    found = []
    if (words := word_count(text)) > MAX_README_WORDS:
        found.append(f"{words} words, more than {MAX_README_WORDS}")
    found += [f"names a test or tells how it was checked: {line.strip()!r}"
              for line in text.splitlines() if re.search(r"\btest_\w+", line) or CHECKED.search(line)]
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


# how the project was made, or how a page was checked: no page tells it (git keeps the history)
DIARY = re.compile(r"\b[Ss]ession \d+|\bsession's\b|working day|\bwas measured by\b|\bin this session\b|"
                   r"measured by an earlier version", re.I)
CHECKED = re.compile(r"\bchecked by\b|\btargets?\b.{0,40}\b(met|missed)\b|\bboth missed\b", re.I)
ISSUE = re.compile(r"\bissues? #?\d+|\(" + "issue" + r"\b", re.I)  # the tracker readers cannot see


@pytest.mark.parametrize("md", MARKDOWN, ids=[str(m.relative_to(REPO)) for m in MARKDOWN])
def test_no_page_tells_how_the_project_was_built(md):
    lines = [line.strip() for line in md.read_text().splitlines() if DIARY.search(line) or CHECKED.search(line)]
    assert not lines, "\n".join(lines)


def test_no_file_names_an_issue_number():
    """Code, tests, scripts and pages: an issue number means nothing to a reader of the repository."""
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    found = []
    for name in tracked.split():
        path = REPO / name
        if path.suffix in {".png", ".pt"} or not path.is_file():
            continue
        found += [f"{name}: {line.strip()}" for line in path.read_text(errors="replace").splitlines()
                  if ISSUE.search(line)]
    assert not found, "\n".join(found)
    assert ISSUE.search("fixed (iss" "ue 45)") and ISSUE.search("Iss" "ue #12") and not ISSUE.search("issues a warning")


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


COMMENT = re.compile(r"<!--.*?-->", re.S)


def word_count(text: str) -> int:
    """The words a reader sees: not the generator's HTML comments (its code, a part's hidden line)."""
    return len(COMMENT.sub("", text).split())


TEST_COUNT = re.compile(r"\b\d[\d,]* (?:tests|passed)\b")


def test_a_test_count_is_given_on_one_page_at_most():
    """The suite's size changes with every test: the contributors' page says it, no learner's page."""
    pages = [str(md.relative_to(REPO)) for md in MARKDOWN if TEST_COUNT.search(md.read_text())]
    assert pages in ([], ["CONTRIBUTING.md"]), pages
    assert TEST_COUNT.search("the whole suite, 568 tests, passed") and not TEST_COUNT.search("test_x passed")


DOCS = sorted((REPO / "docs").glob("*.md"))
MAX_DOC_WORDS = 3500
MAX_DOCS_WORDS = 20000


@pytest.mark.parametrize("md", DOCS, ids=[m.name for m in DOCS])
def test_every_docs_page_says_who_it_is_for_and_stays_short(md):
    """A docs page opens, under its title, with one sentence on who it is for; at most 3,500 words; it
    names no test (the contributors' page lists them)."""
    opening = md.read_text().split("\n\n")[1]
    assert opening.startswith("For "), opening
    assert word_count(md.read_text()) <= MAX_DOC_WORDS
    named = [line.strip() for line in COMMENT.sub("", md.read_text()).splitlines()
             if re.search(r"\btest_\w+|\btests/test_", line)]
    assert not named, "\n".join(named)


def test_the_docs_together_stay_short():
    words = {md.name: word_count(md.read_text()) for md in DOCS}
    assert sum(words.values()) <= MAX_DOCS_WORDS, words


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
