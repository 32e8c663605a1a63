"""One ResNet50, two pipelines: main.py (RPC) and pipelining.py (torch.distributed.pipelining)
train what one process trains.

Each engine runs as ``main()`` launches it (its ``run_worker``, its training loop), over
--splits 1 and 4 in one job, for two batches with SGD; one process then
trains the same two shards from the same seeds over the same micro-batches. The losses the
runs return and log, and both halves' final weights, must agree with ``assert_close``.
"""
from __future__ import annotations

import argparse
import functools
import inspect
import json
import re

from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.optim as optim

import distkit
from conftest import (REPO, Here, keep_weights, on_cuda_optimizer_path, refused_before_launch, run_cli, run_torchrun,
                      saved_result)
import rpc_pipeline_resnet.main as rpc_example
import rpc_pipeline_resnet.pipelining as pp_example
from distkit.schedules import schedule_problem
from rpc_pipeline_resnet.model import ResNetShard1, ResNetShard2

BATCH, IMAGE, NUM_CLASSES, LR, SEED = 8, 48, 10, 0.001, 3
SPLITS = (1, 4)
COMMON = ("--threads", "1", "--batch_size", str(BATCH), "--image_size", str(IMAGE),
          "--num_classes", str(NUM_CLASSES), "--num_batches", "2",
          "--lr", str(LR), "--seed", str(SEED))
# One intra-op thread everywhere: BatchNorm over 2-image micro-batches amplifies rounding
# (another thread count moves the second step's loss by 5 %, measured). What is left differs
# in the order micro-batches' gradients are added (RPC: as they arrive).
LOSS_TOL = {"rtol": 1e-4, "atol": 1e-5}
WEIGHT_TOL = {"rtol": 1e-3, "atol": 2e-3}  # two steps apart, as in test_rpc_pipeline_resnet


def _rpc_worker(rank: int, args: argparse.Namespace):
    """main.py's run_worker (--trace started by its first line), with the shards' weights kept (the
    master only)."""
    kept = keep_weights(rpc_example, "run_master")
    runs = saved_result(rpc_example.run_worker, rank, args)
    return runs and [run | weights for run, weights in zip(runs, kept)]


def _pp_worker(rank: int, args: argparse.Namespace):
    """pipelining.py's run_worker (--trace started by its first line), with this rank's stage's weights kept."""
    kept = keep_weights(pp_example, "run_pipeline")
    runs = saved_result(pp_example.run_worker, rank, args)
    return [run | weights for run, weights in zip(runs, kept)]


def launch(module, worker, *argv: str) -> tuple[argparse.Namespace, list[dict]]:
    """One job; its runs as one list, each run's weights a pair (the halves) in both engines,
    and its losses the last stage's (pipelining: rank 1 computes them)."""
    parser = module.build_parser()
    args = parser.parse_args([*COMMON, *argv])
    module.check_args(parser, args)
    results = distkit.launch(worker, args)
    if module is rpc_example:
        return args, results[0]
    return args, [r1 | {"before": r0["before"] + r1["before"], "after": r0["after"] + r1["after"]}
                  for r0, r1 in zip(results[0], results[1])]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[argparse.Namespace, list[dict]]]:
    splits = [str(m) for m in SPLITS]
    return {
        "rpc": launch(rpc_example, _rpc_worker, "--splits", *splits),
        "GPipe": launch(pp_example, _pp_worker, "--world_size", "2", "--splits", *splits,
                        "--trace", str(tmp_path_factory.mktemp("trace"))),
        # with the SGD step CUDA takes by default (foreach), which the CPU does not
        "1F1B": launch(pp_example, functools.partial(on_cuda_optimizer_path, _pp_worker), "--world_size", "2",
                       "--splits", str(SPLITS[-1]), "--schedule", "1F1B"),
    }


def one_process(num_split: int, batches: int) -> tuple[list[float], list[dict]]:
    """The same training in this process: the shards from the seeds, the data as both
    engines draw it, the same micro-batches one after another, one SGD over both halves."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        s1 = ResNetShard1("cpu", num_classes=NUM_CLASSES, seed=SEED)
        s2 = ResNetShard2("cpu", num_classes=NUM_CLASSES, seed=SEED + 1)
        opt = optim.SGD([*s1.parameters(), *s2.parameters()], lr=LR)
        gen = torch.Generator().manual_seed(SEED)
        one_hot_indices = torch.randint(0, NUM_CLASSES, (BATCH, 1), generator=gen)
        labels = torch.zeros(BATCH, NUM_CLASSES).scatter_(1, one_hot_indices, 1)
        losses = []
        for _ in range(batches):
            inputs = torch.randn(BATCH, 3, IMAGE, IMAGE, generator=gen)
            outputs = torch.cat([s2(Here(s1(Here(x)))) for x in inputs.tensor_split(num_split)])
            loss = nn.MSELoss()(outputs, labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, [{k: v.detach().clone() for k, v in s.state_dict().items()} for s in (s1, s2)]
    finally:
        torch.set_num_threads(threads)


@pytest.mark.fast  # also on Python 3.10 and 3.13 (.ci/run)
@pytest.mark.parametrize("num_split", SPLITS)
def test_both_pipelines_train_what_one_process_trains(runs, num_split):
    losses, weights = one_process(num_split, 2)
    engines = ["rpc", "GPipe"] + (["1F1B"] if num_split == SPLITS[-1] else [])
    for engine in engines:
        args, engine_runs = runs[engine]
        run = next(r for r in engine_runs if r["num_split"] == num_split)
        where = f"{engine}, {num_split} split(s)"
        torch.testing.assert_close(run["losses"], losses, **LOSS_TOL, msg=lambda m: f"{where}: {m}")
        # both halves, both engines: the shards' (RPC) or the stages' state_dict, one key set
        for half, (before, after, expected) in enumerate(zip(run["before"], run["after"], weights)):
            assert after.keys() == expected.keys(), where
            for name, value in expected.items():
                if name.endswith("num_batches_tracked"):  # one update per micro-batch
                    assert int(after[name]) == int(value) == 2 * num_split, (where, name)
                elif "running" not in name or engine != "rpc":
                    # running statistics too, but not RPC's: updated in the order the
                    # micro-batches take the shard's lock, which is not fixed
                    torch.testing.assert_close(after[name], value, **WEIGHT_TOL,
                                               msg=lambda m: f"{where}, half {half + 1}, {name}: {m}")
            moved = "seq.0.weight" if half == 0 else "fc.weight"
            assert not torch.equal(after[moved], before[moved]), (where, "did not train")


def test_both_pipelines_start_from_the_same_weights(runs):
    first = runs["rpc"][1][0]["before"]
    for engine, (_, engine_runs) in runs.items():
        for run in engine_runs:
            for mine, theirs in zip(run["before"], first):
                assert mine.keys() == theirs.keys(), engine
                assert all(torch.equal(mine[k], theirs[k]) for k in mine), (engine, run["num_split"])


def test_pipelining_trace_has_gpipes_spans_for_every_micro_batch(runs):
    """--trace: each rank's torch.profiler trace holds the spans GPipe itself records, a
    "Forward i" and a "Backward i" per micro-batch per batch, for every split value."""
    args, engine_runs = runs["GPipe"]
    batches = args.num_batches
    for rank in (0, 1):
        events = json.loads((Path(args.trace) / f"rank{rank}.json").read_text())["traceEvents"]
        names = [e.get("name") for e in events]
        for kind in ("Forward", "Backward"):
            # micro-batch i occurs in every run whose split value exceeds i
            for i in range(max(SPLITS)):
                expected = batches * sum(1 for m in SPLITS if m > i)
                assert names.count(f"{kind} {i}") == expected, (rank, kind, i)


SMALL = ("--batch_size", "4", "--image_size", "32", "--num_batches", "1",
         "--num_classes", "10", "--splits", "2")


def test_torchrun_launch_prints_the_same_lines():
    """One rank per process under torchrun, as the pipelining tutorial launches it."""
    proc = run_torchrun(2, "rpc_pipeline_resnet/pipelining.py", *SMALL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[rank 0] Processing batch 0" in proc.stdout, proc.stdout
    assert "number of splits = 2, execution time = " in proc.stdout, proc.stdout
    assert re.search(r"\[rank 1\] losses with 2 split\(s\): \d+\.\d{4}\n", proc.stdout), proc.stdout


def readme_command(script: str) -> list[str]:
    """The first command of rpc_pipeline_resnet/README.md's code blocks that runs ``script``
    with the venv's ``python``, as argv after it (its comment dropped)."""
    text = (REPO / "rpc_pipeline_resnet" / "README.md").read_text()
    line = next(l for l in text.splitlines() if l.startswith(f".venv/bin/python {script}"))
    return line.split("#")[0].split()[1:]


@pytest.mark.fast  # the README's command must run on every Python CI runs too
def test_the_readme_command_runs_on_this_torch(capsys):
    """``python rpc_pipeline_resnet/pipelining.py --world_size 2``, at small sizes: its default
    --splits are each run, and no warning is printed (as tests/test_quiet_output.py checks the
    other scripts); with 1F1B, which wants a micro-batch per stage, 1 is left out with one line."""
    argv = readme_command("rpc_pipeline_resnet/pipelining.py")
    assert "--splits" not in argv, argv  # the default list is what is checked here
    proc = run_cli(*argv, "--image_size", "32", "--num_batches", "1",
                   "--num_classes", "10", timeout=180, env={"PYTHONWARNINGS": ""})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    warnings = [line for line in (proc.stdout + proc.stderr).splitlines() if re.search("warn", line, re.I)]
    assert not warnings, "\n".join(warnings)
    assert re.findall(r"number of splits = (\d+),", proc.stdout) == ["1", "2", "4", "8"], proc.stdout
    assert "skipping" not in proc.stdout, proc.stdout
    assert pp_example.runnable_splits([1, 2, 4, 8], "1F1B") == [2, 4, 8]
    assert (f"skipping --splits 1: 1F1B on 2 stages: {schedule_problem('1F1B', 2, 1)} (torch "
            f"{torch.__version__.split('+')[0]})\n") in capsys.readouterr().out


BAD_INPUT = [
    (["--splits", "3"], "--splits values must divide --batch_size 16"),
    (["--schedule", "1F1B", "--splits", "1", "2"], "--schedule 1F1B --splits 1: Number of microbatches (1)"),
    (["--schedule", "Interleaved1F1B"], "invalid choice: 'Interleaved1F1B'"),
    (["--world_size", "3"], "--world_size must be at most 2"),
    (["--splits", "2", "--image_size", "8", "--batch_size", "4"], "give BatchNorm"),  # main.py's check
    (["--splits", "2", "--lr", "0"], "argument --lr: must be a positive number, got 0.0"),
]


@pytest.mark.fast
@pytest.mark.parametrize("argv, message", BAD_INPUT)
def test_bad_input_is_rejected_before_launch(argv, message, capsys, monkeypatch):
    err = refused_before_launch(pp_example.main, argv, capsys, monkeypatch)
    assert message in err, err


def test_bad_input_cli_is_one_line_exit_2():
    proc = run_cli("rpc_pipeline_resnet/pipelining.py", "--splits", "3", timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and BAD_INPUT[0][1] in proc.stderr, proc.stderr
    assert "[rank" not in proc.stdout  # nothing was spawned


class _Launched(Exception):
    """Raised where a rank would set itself up, with the flags it was given."""


@pytest.mark.fast
@pytest.mark.parametrize("module, loop, params, argv", [
    (rpc_example, "run_master", ["num_split", "args", "devices"], []),
    (pp_example, "run_pipeline", ["num_split", "args", "rank", "device"], ["--world_size", "2"])])
def test_the_tutorial_functions_hold_no_measurement(module, loop, params, argv, tmp_path, monkeypatch):
    """The loop takes its arguments alone, no hook (the benchmark, the pictures and the tests patch the
    model and the optimizer from outside: scripts/resnet_meters.py, keep_weights); run_worker starts no
    profiler; main() spawns run_worker as the tutorial does, and its first line, distkit.start_rank, gets
    --trace (it runs the rank under the profiler)."""
    assert list(inspect.signature(getattr(module, loop)).parameters) == params
    source = inspect.getsource(module.run_worker)
    assert "profile" not in source and "record_function" not in source, source
    spawned = {}

    def spawn(fn, args, nprocs, join):
        spawned.update(fn=fn, nprocs=nprocs, join=join)
        fn(0, *args)

    def start_rank(rank: int, args: argparse.Namespace) -> None:
        raise _Launched(rank, args)

    monkeypatch.setattr(distkit, "prepare_spawn", lambda: None)
    monkeypatch.setattr(module.mp, "spawn", spawn)
    monkeypatch.setattr(distkit, "start_rank", start_rank)
    with pytest.raises(_Launched) as started:
        module.main([*argv, "--trace", str(tmp_path)])
    rank, args = started.value.args
    assert spawned == {"fn": module.run_worker, "nprocs": args.world_size, "join": True}
    assert rank == 0 and args.trace == str(tmp_path)
