"""Inside a pipeline: the example's ``--trace`` (torch.profiler), and the benchmark's
instruments: the planned (ideal) bubbles (scripts/pipeline_plan.py) and each rank's
compute as ``scripts/stagetrace.py`` records it."""
from __future__ import annotations

import ast
import json
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

import distkit
from conftest import REPO, checked_args, refused_before_launch
from distkit.schedules import SCHEDULES, num_stages_for, stage_indices_for
from pipelining_transformer import train as example

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_pipelining_transformer as bench  # noqa: E402
import stagetrace  # noqa: E402
from pipeline_plan import action_table, plan  # noqa: E402

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


def spans_by_step(steps: list[list[tuple]]):
    """Compute spans keyed by (step, kind, stage, micro-batch): how many, and the last one."""
    out = Counter()
    found = {}
    for step, spans in enumerate(steps):
        for s in map(lambda t: stagetrace.Span(*t), spans):
            if s.kind in stagetrace.COMPUTE:
                key = (step, s.kind, s.stage, s.microbatch)
                out[key] += 1
                found[key] = s
    return out, found


@pytest.mark.parametrize("schedule", ["GPipe", "ZBVZeroBubble"])
def test_stagetrace_records_every_action_once_in_dependency_order(schedule):
    """The benchmark's compute clock: every forward / backward / weight gradient of every
    stage and micro-batch, once per step, on one clock across the ranks."""
    steps, m = 2, 2
    args = checked_args("pipelining_transformer.train", *TINY, "--schedule", schedule,
                        "--n_microbatches", str(m), "--steps", str(steps))
    ranks = distkit.launch(bench.pipeline_worker, args)
    spans = [[s for r in ranks.values() for s in r["spans"][step]] for step in range(steps)]
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
    assert any(s[1] == "recv" and s[0] == 1 and s[4] == 1 for step in spans for s in step)


@pytest.mark.fast  # also on Python 3.10 and 3.13 (.ci/run)
def test_stagetrace_wraps_only_names_this_torch_has():
    """scripts/stagetrace.py, the one module that patches torch to measure, wraps names this
    PyTorch still has: a rename upstream fails here, naming what to re-check."""
    missing = [f"{getattr(owner, '__name__', owner)}.{name}" for owner, names in stagetrace.PATCHED
               for name in names if not hasattr(owner, name)]
    assert not missing, f"torch {torch.__version__} lacks {missing}: re-check scripts/stagetrace.py"


@pytest.mark.fast
def test_no_private_attribute_is_assigned_outside_stagetrace():
    """One module to re-check on a new torch: ``obj._name = ...`` (not on self or cls) or
    ``setattr(obj, "_name", ...)`` anywhere else in distkit, the examples or scripts fails here."""
    found = []
    for path in sorted(REPO.glob("*/*.py")):
        if path.parent.name.startswith((".", "tests", "build")) or path.name == "stagetrace.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            named = [t.attr for t in targets if isinstance(t, ast.Attribute)
                     and not (isinstance(t.value, ast.Name) and t.value.id in {"self", "cls"})]
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr":
                named += [a.value for a in node.args[1:2] if isinstance(a, ast.Constant)]
            found += [f"{path.relative_to(REPO)}:{node.lineno} {n}" for n in named  # a dunder is no private API
                      if n.startswith("_") and not (n.startswith("__") and n.endswith("__"))]
    assert not found, found


def test_trace_holds_every_action_the_schedule_ran(tmp_path):
    """--trace: each rank's torch.profiler trace holds the span ZBVZeroBubble's runtime records
    per action ("PP:0F1"): a forward, an input gradient and a weight gradient per stage this
    rank holds, micro-batch and step (GPipe's own spans: test_resnet_two_pipelines)."""
    steps, m = 2, 2
    assert example.main([*TINY, "--schedule", "ZBVZeroBubble", "--n_microbatches", str(m),
                         "--steps", str(steps), "--trace", str(tmp_path)]) == 0
    for rank in (0, 1):
        events = json.loads((tmp_path / f"rank{rank}.json").read_text())["traceEvents"]
        names = Counter(e.get("name") for e in events)
        for stage in stage_indices_for("ZBVZeroBubble", rank, 2):
            for mb in range(m):
                for kind in "FIW":
                    assert names[f"PP:{stage}{kind}{mb}"] == steps, (rank, stage, kind, mb)


def test_trace_into_a_file_is_refused_before_launch(tmp_path, capsys, monkeypatch):
    file = tmp_path / "not_a_dir"
    file.write_text("")
    err = refused_before_launch(example.main, [*TINY, "--trace", str(file)], capsys, monkeypatch)
    assert "is a file, not a directory" in err, err
