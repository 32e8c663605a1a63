"""The rpc_pipeline_resnet and pipelining_transformer benchmarks run once on a tiny configuration.

Complete, finite tables; nothing is timed against a threshold.
"""
from __future__ import annotations

import importlib
import math
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))


def run_bench(name: str, argv: list[str], capsys) -> tuple[list[dict], str]:
    rows = importlib.import_module(name).main(argv)
    return rows, capsys.readouterr().out


def assert_finite(rows: list[dict], keys: list[str]) -> None:
    for row in rows:
        for key in keys:
            assert isinstance(row[key], (int, float)) and math.isfinite(row[key]), (key, row)


def test_bench_rpc_pipeline_resnet(capsys, tmp_path):
    from bench_rpc_pipeline_resnet import NUMERIC

    plot = tmp_path / "resnet.png"
    # --quick, cut to two configurations: the sweep's (32 px, 2 splits) and the table's 1 split;
    # one thread for the "user" reference too (two OpenMP threads crawl on a loaded machine)
    rows, out = run_bench("bench_rpc_pipeline_resnet",
                          ["--quick", "--sizes", "32", "--splits", "1", "--table_size", "32",
                           "--user_threads", "1", "--plot", str(plot)], capsys)
    assert out.startswith("# machine:")
    # both engines in one run; 1F1B cannot run one micro-batch
    assert [(r["engine"], r["m"]) for r in rows] == [
        ("rpc", 1), ("rpc", 2), ("pp GPipe", 1), ("pp GPipe", 2), ("pp 1F1B", 2)]
    assert {r["engine"]: r["procs"] for r in rows} == {"rpc": 3, "pp GPipe": 2, "pp 1F1B": 2}
    assert_finite(rows, NUMERIC)
    for r in rows:
        assert min(r["s/batch"], r["floor"], r["user s"], r["seq s"], r["GFLOP/mb"]) > 0
        # every speed-up beside its bound, all against the machine's floor
        assert r["x user"] == pytest.approx(r["user s"] / r["s/batch"])
        assert r["bound"] == pytest.approx(r["user s"] / r["floor"])
        assert r["x seq"] == pytest.approx(r["seq s"] / r["s/batch"])
        assert r["bound "] == pytest.approx(r["seq s"] / r["floor"])
        assert r["eff."] == pytest.approx(r["x seq"] / r["bound "])
        if "x 1 split" in r:
            assert r["eff."] == pytest.approx(r["x 1 split"] / r["bound 1"])
        assert r["2m/(m+1)"] == pytest.approx(2 * r["m"] / (r["m"] + 1))
        above = [k for k, b in (("x user", "bound"), ("x seq", "bound "), ("x 1 split", "bound 1"))
                 if k in r and r[k] > r[b]]
        assert bool(above) == ("ERROR" in r["flag"]), r
        assert len(r["losses"]) == 2  # warm-up + timed batch: the example really trained
        assert len(r["batch_times"]) == 1  # the meter's windows: one a batch, the warm-up one left out
        assert len(r["peak MB"].split("/")) == r["procs"] and len(r["CPU s/shard"].split("/")) == 2
        if r["engine"] != "rpc":  # the same model, data and micro-batches: the same losses
            rpc = next(x for x in rows if x["engine"] == "rpc" and x["m"] == r["m"])
            assert r["vs rpc"] == pytest.approx(rpc["s/batch"] / r["s/batch"])
            assert r["losses"] == pytest.approx(rpc["losses"], rel=1e-3)
    assert rows[0]["GFLOP/mb"] == pytest.approx(2 * rows[1]["GFLOP/mb"])  # 4 images, then 2
    for r in rows:  # two stages of one core each: the busier stage plus one micro-batch of the other
        a, b = sorted(r["shard cpu"])
        assert r["model"] == pytest.approx(r["floor"] / (b + a / r["m"]))
    assert plot.stat().st_size > 0


def test_bench_pipelining_transformer(capsys, tmp_path):
    from bench_pipelining_transformer import HEADER

    plot = tmp_path / "pp.png"
    rows, out = run_bench("bench_pipelining_transformer",
                          ["--schedules", "GPipe", "Interleaved1F1B", "--microbatches", "2",
                           "--steps", "3", "--model", "16", "4", "2", "50", "--batch_size", "4",
                           "--seq_len", "4", "--plot", str(plot)], capsys)
    assert out.startswith("# machine:")
    assert [(r["schedule"], r["m"]) for r in rows] == [("GPipe", 2), ("Interleaved1F1B", 2)]
    assert_finite(rows, [k for k in HEADER if k not in ("schedule", "split", "peak MB/rank")])
    for r in rows:
        assert min(r["step ms"], r["local step ms"], r["1-thread step ms"], r["peak MB"]) > 0
        assert 0 <= r["bubble"] < 1
        assert r["tokens/s"] == pytest.approx(4 * 4 * 1e3 / r["step ms"])
        assert len(r["peak MB/rank"].split(" / ")) == 2
    # from each schedule's own table with unit costs: (p - 1) / (v m + p - 1) for these two,
    # one stage per rank for GPipe, two for Interleaved1F1B
    assert [r["ideal bubble"] for r in rows] == pytest.approx([1 / 3, 1 / 5])
    assert plot.stat().st_size > 0


def test_bench_pipelining_transformer_sweep(capsys, tmp_path):
    from bench_pipelining_transformer import SWEEP_HEADER

    plot = tmp_path / "sweep.png"
    rows, out = run_bench("bench_pipelining_transformer",
                          ["--sweep", "--quick", "--schedules", "1F1B", "--points", "4x4",
                           "--model", "16", "2", "2", "50", "--stage_layers", "even", "auto",
                           "--plot", str(plot)], capsys)
    assert [(r["schedule"], r["split flag"], r["m"], r["batch"], r["tokens/mb"]) for r in rows] == [
        ("1F1B", "even", 4, "4x4", 4), ("1F1B", "auto", 4, "4x4", 4)]
    assert_finite(rows, [k for k in SWEEP_HEADER if k not in ("schedule", "split", "batch", "binds", "peak MB/rank")])
    # auto names what it chose, a split of the 2 layers (halves allowed) into 2 stages
    chosen = [float(n) for n in rows[1]["split"].removeprefix("auto: ").split()]
    assert sum(chosen) == 2 and len(chosen) == 2 and all(2 * n % 1 == 0 for n in chosen), rows[1]["split"]
    assert "# auto against even: " in out
    assert len(rows[0]["peak MB/rank"].split(" / ")) == 2
    r = rows[0]
    assert r["bound"] == pytest.approx(2 * 4 / (4 + 2 - 1))  # p m / (m + p - 1)
    assert r["speed-up"] == pytest.approx(r["local step ms"] / r["step ms"])
    # the factors multiply to the efficiency, the smaller is the one named, and the
    # efficiency is the speed-up over the ranks' own compute (C = sequential ms / compute)
    # divided by the bound
    assert r["balance"] * r["overlap"] == pytest.approx(r["efficiency"])
    assert 0 < r["balance"] <= 1 and 0 < r["efficiency"] <= 1
    assert r[r["binds"]] == min(r["balance"], r["overlap"])
    assert r["sequential ms"] / r["compute"] / r["schedule ms"] == pytest.approx(r["efficiency"] * r["bound"])
    assert r["ideal bubble"] == pytest.approx(1 / 5)
    assert r["bubble/ideal"] == pytest.approx(r["bubble"] / r["ideal bubble"])
    assert "# crossover, 1F1B, even: " in out and "# crossover, 1F1B, auto: " in out
    assert plot.stat().st_size > 0


def test_step_seconds_drops_warmup():
    from bench_pipelining_transformer import step_seconds

    assert step_seconds([1.0, 3.0, 6.0, 10.0], warmup=1) == [2.0, 3.0, 4.0]
    assert step_seconds([1.0, 3.0, 6.0, 10.0], warmup=2) == [3.0, 4.0]
