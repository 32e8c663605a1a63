"""scripts/make_pictures.py: every picture the READMEs embed is one it writes, from runs whose
distributed and one-process series agree."""
from __future__ import annotations

import re
import struct
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
import make_pictures  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"
# a markdown image, ![alt](path) or ![alt](path "title")
IMAGE = re.compile(r"!\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("pictures")
    return out, make_pictures.main(["--quick", "--out", str(out)])


def test_every_picture_is_written_as_a_small_png(made):
    out, data = made
    assert sorted(data) == sorted(make_pictures.PICTURES)
    for name in make_pictures.PICTURES:
        raw = (out / name).read_bytes()
        assert raw[:8] == PNG and raw[12:16] == b"IHDR", name
        width, height = struct.unpack(">II", raw[16:24])
        # about 8 x 4 inches at 100 dpi: small enough to read at a glance
        assert 600 <= width <= 1000 and 300 <= height <= 500, (name, width, height)
        assert 10_000 < len(raw) < 150_000, (name, len(raw))
        with Image.open(out / name) as image:
            image.load()  # decodes every pixel: a truncated or corrupt file raises here


@pytest.mark.parametrize("name", make_pictures.PARITY)
def test_each_parity_picture_shows_two_series_that_agree(made, name):
    """What makes the picture honest: the distributed run's series is the one-process series,
    point for point, to float32 tolerance (the runs' ranks round differently from this process:
    conftest's workers_round_differently)."""
    curves = made[1][name]
    assert len(curves.distributed) == len(curves.one_process) >= 3, name
    torch.testing.assert_close(torch.tensor(curves.distributed, dtype=torch.float64),
                               torch.tensor(curves.one_process, dtype=torch.float64), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", make_pictures.PARITY)
def test_each_parity_pictures_one_process_curve_is_the_tests_reference(made, name):
    """The one-process curve is what a test's own one-process run gives, run again here: not the
    distributed run's series, nor a reference of the picture's own (which could drift from the tests')."""
    curves = made[1][name]
    assert curves.reference.func.__module__.startswith("test_"), curves.reference.func
    with make_pictures.one_thread():
        again = curves.pick(curves.reference())
    assert again == curves.one_process  # the same computation in this process, to the bit


@pytest.mark.parametrize("name", make_pictures.SCHEDULES)
def test_each_timeline_holds_every_stages_work_on_every_micro_batch(made, name):
    """Each panel's rows hold one forward and one backward (and, where the schedule defers them, one
    weight gradient) of each micro-batch for each stage the row's rank or shard runs."""
    for timeline in made[1][name]:
        for label, spans in timeline.rows:
            stages = sorted({s.stage for s in spans})
            kinds = sorted({s.kind for s in spans})
            expected = sorted((k, stage, mb) for k in kinds for stage in stages
                              for mb in range(make_pictures.MICROBATCHES))
            assert sorted((s.kind, s.stage, s.microbatch) for s in spans) == expected, (timeline.title, label)
            assert kinds in (["B", "F"], ["B", "F", "W"]), (timeline.title, label)
            assert all(s.end >= s.start for s in spans)


def embedded_pictures() -> list[tuple[Path, str, Path]]:
    """Every (page, link, file) of a markdown image that points into docs/pictures/, on README.md,
    every <folder>/README.md and docs/*.md."""
    pages = [REPO / "README.md", *sorted(REPO.glob("*/README.md")), *sorted(REPO.glob("docs/*.md"))]
    found = []
    for page in pages:
        for link in IMAGE.findall(page.read_text()):
            target = (page.parent / link.split("#")[0]).resolve()
            if target.parent == (REPO / "docs" / "pictures").resolve():
                found.append((page, link, target))
    return found


@pytest.mark.fast
def test_every_picture_a_page_embeds_is_one_the_script_writes():
    for page, link, target in embedded_pictures():
        where = f"{page.relative_to(REPO)} embeds {link}"
        assert target.name in make_pictures.PICTURES, f"{where}: scripts/make_pictures.py writes no such picture"
        assert target.is_file(), f"{where}: missing (.venv/bin/python scripts/pages.py draws it)"


@pytest.mark.fast
def test_the_pictures_the_script_writes_are_in_the_repository():
    for name in make_pictures.PICTURES:
        assert (REPO / "docs" / "pictures" / name).is_file(), f"docs/pictures/{name}: run scripts/pages.py"


@pytest.mark.fast
@pytest.mark.parametrize("argv, message", [
    (["--only", "rpc_rl.png"], "argument --only: invalid choice: 'rpc_rl.png'"),
    (["--out", "pyproject.toml"], "is a file, not a directory"),
    (["--quick", "3"], "unrecognized arguments: 3"),
])
def test_bad_flags_are_one_line_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        make_pictures.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and message in err, err
