"""pipelining_transformer's planned (ideal) bubbles and its measured ``--trace`` timelines."""
from __future__ import annotations

import json
from collections import Counter

import pytest

from distkit.schedules import SCHEDULES, num_stages_for
from pipelining_transformer import main as example
from pipelining_transformer.planned import action_table, plan

ZERO_BUBBLE = ["InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]
TINY = ["--dim", "32", "--n_layers", "4", "--n_heads", "2", "--vocab_size", "64", "--dropout", "0",
        "--device", "cpu", "--world_size", "2", "--batch_size", "4", "--seq_len", "8"]


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8)])
def test_ideal_bubble_from_the_schedules_table(p, m):
    ideal = {s: plan(s, p, m) for s in SCHEDULES}
    # by hand: m forwards and backwards on each rank, the last one starts p - 1 slots late
    classic = (p - 1) / (m + p - 1)
    assert ideal["GPipe"].bubble == pytest.approx(classic)
    assert ideal["1F1B"].bubble == pytest.approx(classic)
    assert ideal["GPipe"].idle == pytest.approx([classic] * p)
    # two stages per rank, each half the work: the same slots, twice as many of them
    for s in ("Interleaved1F1B", "LoopedBFS"):
        assert ideal[s].bubble == pytest.approx((p - 1) / (2 * m + p - 1)), s
    for s in ZERO_BUBBLE:  # filling the bubble with weight gradients is their point
        assert ideal[s].bubble < (p - 1) / (2 * m + p - 1) < classic, s
    # p = 2, m = 4, by hand: each rank is busy 4 x 2 stages x (F 1 + I 1 + W 1) = 24 units;
    # only rank 1's first slot waits (for 0F0), so the makespan is 25
    if (p, m) == (2, 4):
        for s in ZERO_BUBBLE:
            assert ideal[s].bubble == pytest.approx(1 / 25), s


def test_1f1b_table_is_what_its_runtime_runs():
    # torch 2.14.1's own 1F1B table skips micro-batch 0 on the last rank: ours is the runtime's
    table = action_table("1F1B", 2, 4)
    assert [f"{k}{mb}" for k, _, mb in table[0]] == "F0 F1 B0 F2 B1 F3 B2 B3".split()
    assert [f"{k}{mb}" for k, _, mb in table[1]] == "F0 B0 F1 B1 F2 B2 F3 B3".split()


def spans_by_step(spans):
    """Compute spans keyed by (step, kind, stage, micro-batch), each step from its rank's window."""
    steps = [s for s in spans if s.kind == "step"]
    out = Counter()
    found = {}
    for s in spans:
        if s.kind in ("F", "B", "W"):
            step = [t.microbatch for t in steps if t.rank == s.rank and t.start <= s.start <= t.end]
            assert len(step) == 1, s
            key = (step[0], s.kind, s.stage, s.microbatch)
            out[key] += 1
            found[key] = s
    return out, found


@pytest.mark.parametrize("schedule", ["GPipe", "ZBVZeroBubble"])
def test_trace_every_action_once_in_dependency_order(schedule, tmp_path):
    from distkit.timeline import read_chrome_trace

    steps, m = 2, 2
    folder = tmp_path / "trace"
    assert example.main([*TINY, "--schedule", schedule, "--n_microbatches", str(m),
                         "--steps", str(steps), "--trace", str(folder)]) == 0
    for name in ("trace.json", "planned.json", "rank0.json", "rank1.json"):
        assert json.loads((folder / name).read_text())["traceEvents"]  # valid Chrome trace JSON
    assert (folder / "timeline.png").stat().st_size > 10_000
    spans = read_chrome_trace(folder / "trace.json")
    assert {s.rank for s in spans} == {0, 1}
    # the merged file is the ranks' own files together
    assert sorted(spans, key=repr) == sorted(read_chrome_trace(folder / "rank0.json")
                                             + read_chrome_trace(folder / "rank1.json"), key=repr)

    count, found = spans_by_step(spans)
    n_stages = num_stages_for(schedule, 2)
    backward = ["B", "W"] if schedule in ZERO_BUBBLE else ["B"]
    expected = {(step, kind, stage, mb): 1 for step in range(steps) for stage in range(n_stages)
                for mb in range(m) for kind in ["F", *backward]}
    assert dict(count) == expected  # each forward / backward / weight gradient exactly once

    # one clock: a stage's forward of i starts after the previous stage's forward of i ended,
    # a backward after the next stage's backward (its input gradient) ended, across ranks
    for step in range(steps):
        for mb in range(m):
            for stage in range(1, n_stages):
                assert found[step, "F", stage, mb].start >= found[step, "F", stage - 1, mb].end
                assert found[step, "B", stage - 1, mb].start >= found[step, "B", stage, mb].end
    # waits were observed where the data comes from the other rank
    assert any(s.kind == "recv" and s.rank == 1 and s.stage == 1 for s in spans)


def test_trace_into_a_file_is_refused_before_launch(tmp_path, capsys, monkeypatch):
    import distkit

    monkeypatch.setattr(distkit, "Job", lambda *a: pytest.fail("launched despite bad --trace"))
    file = tmp_path / "not_a_dir"
    file.write_text("")
    with pytest.raises(SystemExit) as exit_:
        example.main([*TINY, "--trace", str(file)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a file, not a directory" in err, err
