"""Every benchmark runs once on a tiny configuration: its table is complete and finite.

Nothing here is timed against a threshold; speed is the benchmarks' business.
"""
from __future__ import annotations

import importlib
import math
import sys

from conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))


def run_bench(name: str, argv: list[str], capsys) -> tuple[list[dict], str]:
    module = importlib.import_module(name)
    rows = module.main(argv)
    return rows, capsys.readouterr().out


def assert_finite(rows: list[dict], keys: list[str]) -> None:
    for row in rows:
        for key in keys:
            assert isinstance(row[key], (int, float)) and math.isfinite(row[key]), (key, row)


def test_bench_rpc_rl(capsys, tmp_path):
    plot = tmp_path / "rl.png"
    rows, out = run_bench("bench_rpc_rl", ["--world_sizes", "2", "--speed_episodes", "1",
                                           "--solve_sizes", "2", "--threshold", "0.5",
                                           "--max_episodes", "3", "--rtt_calls", "20",
                                           "--plot", str(plot)], capsys)
    assert out.startswith("# machine:")
    assert "RPC round trip" in out
    speed = [r for r in rows if r["table"] == "speed"]
    solve = [r for r in rows if r["table"] == "solve"]
    assert [r["mode"] for r in speed] == ["tutorial", "batch"]
    assert_finite(speed, ["steps/s", "speed-up", "rpc bound steps/s", "of bound"])
    assert all(r["env_steps"] > 0 for r in speed)
    assert [r["mode"] for r in solve] == ["tutorial", "batch"]
    assert all(r["solved"] and r["episodes"] == 1 for r in solve)  # 0.05 * reward > 0.5 at once
    assert plot.stat().st_size > 0
