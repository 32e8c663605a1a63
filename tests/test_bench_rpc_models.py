"""The ddp_rpc and rpc_rnn benchmarks run once on a tiny configuration: complete, finite tables.

Nothing here is timed against a threshold; speed is the benchmarks' business.
"""
from __future__ import annotations

import importlib
import math
import sys

import pytest

from conftest import REPO, run_cli

sys.path.insert(0, str(REPO / "scripts"))

PHASE_KEYS = [f"{pre}{p} ms" for pre in ("", "local ") for p in ("forward", "backward", "step")]
RATE_KEYS = ["it/s", "local it/s", "ms/it", "local ms/it", "RTTs/it", *PHASE_KEYS]


def run_bench(name: str, argv: list[str], capsys) -> tuple[list[dict], str]:
    rows = importlib.import_module(name).main(argv)
    return rows, capsys.readouterr().out


def assert_complete(rows: list[dict], share: str) -> None:
    for row in rows:
        for key in [*RATE_KEYS, share]:
            assert isinstance(row[key], (int, float)) and math.isfinite(row[key]), (key, row)
        for key in [*RATE_KEYS[:4], *PHASE_KEYS]:
            assert row[key] > 0, (key, row)
        assert row[share] < 1, row
        # it/s is the inverse of the median iteration, not of a sum of phase medians
        assert row["it/s"] == pytest.approx(1e3 / row["ms/it"])


def test_phase_seconds_splits_each_iteration():
    from rpc_phases import phase_seconds

    # (backward start, backward end, step start, step end) of three iterations
    marks = [(0.0, 1.0, 1.0, 2.0), (3.0, 5.0, 6.0, 7.0), (8.0, 9.0, 10.0, 12.0)]
    assert phase_seconds(marks, warmup=1) == {
        "forward": [2.0, 2.0], "backward": [2.0, 1.0], "step": [1.0, 2.0], "iteration": [5.0, 5.0]}
    assert phase_seconds(marks, warmup=2)["iteration"] == [5.0]


def test_bench_rpc_rnn(capsys, tmp_path):
    plot = tmp_path / "rnn.png"
    rows, out = run_bench("bench_rpc_rnn", ["--configs", "tiny", "--iters", "3", "--warmup", "1",
                                            "--rtt_calls", "10", "--plot", str(plot)], capsys)
    assert out.startswith("# machine:")
    assert "RPC round trip" in out and "where the extra time goes" in out
    assert [r["config"] for r in rows] == ["tiny"] and rows[0]["nhid"] == 5
    assert_complete(rows, "rpc share")
    assert plot.stat().st_size > 0


def test_bench_ddp_rpc(capsys, tmp_path):
    plot = tmp_path / "ddp.png"
    rows, out = run_bench("bench_ddp_rpc", ["--trainers", "2", "--batch_sizes", "4", "--iters", "3",
                                            "--warmup", "1", "--rtt_calls", "10", "--plot", str(plot)],
                          capsys)
    assert out.startswith("# machine:")
    assert "RPC round trip" in out and "where the extra time goes" in out
    assert [(r["trainers"], r["batch"]) for r in rows] == [(2, 4)]
    assert_complete(rows, "comm share")
    assert rows[0]["samples/s"] == round(2 * 4 * rows[0]["it/s"])
    assert plot.stat().st_size > 0


def test_cli_run():
    """As a script (its workers pickled from ``__main__``), on a reduced configuration: rpc_rnn's; the
    ddp_rpc benchmark launches through the same rpc_phases.launch_timed and rpc_round_trip."""
    proc = run_cli("scripts/bench_rpc_rnn.py", "--configs", "tiny", "--iters", "2", "--warmup", "1",
                   "--rtt_calls", "5", timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("# machine:")
    assert "where the extra time goes" in proc.stdout


@pytest.mark.parametrize("name, argv", [
    ("bench_ddp_rpc", ["--tables", "tiny", "--trainers", "2", "--batch_sizes", "4"]),
    ("bench_rpc_rnn", ["--configs", "tiny", "--ranks", "2"]),
])
def test_versus_times_both_versions_beside_one_process(name, argv, capsys):
    """--versus: a row per version, each ms/step beside one process's and the speed-up's bound (ddp_rpc's
    runs also check, inside, that both versions trained the table asked for)."""
    rows, out = run_bench(name, [*argv, "--versus", "--iters", "3", "--warmup", "1"], capsys)
    assert [r["version"] for r in rows] == ["RPC (main.py)", "DTensor (sharded.py)"], out
    for row in rows:
        assert row["ms/step"] > 0 and row["1 process ms/step"] > 0, row
        assert row["speed-up"] == pytest.approx(row["1 process ms/step"] / row["ms/step"])
        assert (row["note"] != "") == (row["speed-up"] > row["bound"]), row
    assert rows[1]["bound"] == 2 and rows[0]["bound"] == (1 if name == "bench_rpc_rnn" else 2)
    if name == "bench_ddp_rpc":  # the example's table size is back for the next run in this process (the pages')
        import ddp_rpc.trainer

        assert (ddp_rpc.trainer.NUM_EMBEDDINGS, ddp_rpc.trainer.EMBEDDING_DIM) == (100, 16)


def test_a_speed_up_above_its_bound_is_flagged():
    from rpc_phases import versus_row

    assert versus_row("c", "v", 2, ms=1.0, local_ms=3.0, bound=2)["note"].startswith("ABOVE ITS BOUND")
    assert versus_row("c", "v", 2, ms=1.0, local_ms=1.5, bound=2)["note"] == ""
