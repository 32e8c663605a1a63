"""scripts/resnet_precision.py, whose table docs/results.md gives for the GPU tier's ResNet case: on this CPU,
float32's first loss agrees with float64's (a forward), its loss after a step far less (the step carries the
BatchNorm gradients' rounding), which is why tests/test_cuda.py compares the two apart."""
from __future__ import annotations

import re
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
import pages  # noqa: E402
import resnet_precision  # noqa: E402


@pytest.mark.timeout(300)
def test_float32_is_near_float64_before_a_step_and_further_after_it(capsys):
    rows = resnet_precision.main(["--quick"])  # in this process, as scripts/pages.py runs it
    out = capsys.readouterr().out
    printed = re.findall(r"float32, (\d) thread\(s\): losses \S+ \S+, (\S+) % and (\S+) % from float64", out)
    assert len(printed) == 4, out  # 1 and 2 threads, 1 and 2 micro-batches
    for _, first, after in printed:
        assert float(first) < 1e-2  # percent: float32's rounding of a forward, within 1e-4
        assert float(after) > 10 * float(first), out
    assert len(re.findall(r"first gradients x \(1 \+ \S+ noise\): second loss \S+ % from float64", out)) == 8

    # the rows say the same, with what the page's table reads from them
    float32 = [r for r in rows if "thread(s)" in r["run"]]
    assert [f"{r['first_pct']:.5f}" for r in float32] == [first for _, first, _ in printed]
    assert len([r for r in rows if "noise" in r["run"] and r["moved_pct"] >= 0]) == 8
    table = next(p for p in pages.parts(REPO / "docs" / "results.md")
                 if p["call"] == "pages.table" and p["args"][1] == "resnet_precision")
    assert set(table["args"][3]) <= set().union(*rows), table["args"][3]
