"""One ResNet50, two pipelines: main.py (RPC) and pipelining.py (torch.distributed.pipelining)
train what one process trains.

Each engine runs as ``main()`` launches it (its ``run_worker``, its training loop), over
--splits 1 and 4 in one job, for a warm-up batch and a timed one with SGD; one process then
trains the same two shards from the same seeds over the same micro-batches. The losses the
runs return and print, and both halves' final weights, must agree with ``assert_close``.
"""
from __future__ import annotations

import argparse
import functools
import re

import pytest
import torch
import torch.nn as nn
import torch.optim as optim

import distkit
from conftest import REPO, refused_before_launch, run_cli, run_torchrun
import rpc_pipeline_resnet.main as rpc_example
import rpc_pipeline_resnet.pipelining as pp_example
from distkit.schedules import schedule_problem
from distkit.timeline import read_chrome_trace
from rpc_pipeline_resnet.measure import Meter, print_report
from rpc_pipeline_resnet.model import ResNetShard1, ResNetShard2
from rpc_pipeline_resnet.stage_meter import StageMeter
from rpc_pipeline_resnet.trace import write_trace

BATCH, IMAGE, NUM_CLASSES, LR, SEED = 8, 48, 10, 0.001, 3
# torch 2.10's GPipe refuses fewer micro-batches than stages: there, 2 stands in for 1
SPLITS = (1, 4) if schedule_problem("GPipe", 2, 1) is None else (2, 4)
COMMON = ("--threads", "1", "--batch_size", str(BATCH), "--image_size", str(IMAGE),
          "--num_classes", str(NUM_CLASSES), "--warmup", "1", "--num_batches", "1",
          "--lr", str(LR), "--seed", str(SEED))
# One intra-op thread everywhere: BatchNorm over 2-image micro-batches amplifies rounding
# (another thread count moves the second step's loss by 5 %, measured). What is left differs
# in the order micro-batches' gradients are added (RPC: as they arrive).
LOSS_TOL = {"rtol": 1e-4, "atol": 1e-5}
WEIGHT_TOL = {"rtol": 1e-3, "atol": 2e-3}  # two steps apart, as in test_rpc_pipeline_resnet


def _rpc_worker(worker: distkit.Worker, args: argparse.Namespace):
    """main.py's run_worker; its Meter also copies the shards' weights (this process only)."""
    rpc_example.Meter = functools.partial(Meter, states=True)
    return rpc_example.run_worker(worker, args)


def _pp_worker(worker: distkit.Worker, args: argparse.Namespace):
    """pipelining.py's run_worker; its StageMeter also copies the stages' weights."""
    pp_example.StageMeter = functools.partial(StageMeter, states=True)
    return pp_example.run_worker(worker, args)


def launch(module, worker, *argv: str) -> tuple[argparse.Namespace, list[dict]]:
    parser = module.build_parser()
    args = parser.parse_args([*COMMON, *argv])
    module.check_args(parser, args)
    return args, distkit.launch(worker, args)[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[argparse.Namespace, list[dict]]]:
    splits = [str(m) for m in SPLITS]
    return {
        "rpc": launch(rpc_example, _rpc_worker, "--splits", *splits),
        "GPipe": launch(pp_example, _pp_worker, "--world_size", "2", "--splits", *splits),
        "1F1B": launch(pp_example, _pp_worker, "--world_size", "2", "--splits", str(SPLITS[-1]),
                       "--schedule", "1F1B", "--trace", str(tmp_path_factory.mktemp("trace"))),
    }


class Here:
    """Stands in for an RRef in one process: the shards' forward calls ``to_here()``."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value

    def to_here(self) -> torch.Tensor:
        return self.value


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


def printed_losses(output: str, num_split: int) -> list[float]:
    """The losses the user reads in main()'s table (the same columns for both engines)."""
    rows = [line.split() for line in output[output.index("loss of each batch"):].splitlines()[1:]]
    row = next(r for r in rows if r and r[0] == str(num_split))
    return [float(x) for x in row[10:12]]


@pytest.mark.fast  # also on the oldest supported torch (.ci/run)
@pytest.mark.parametrize("num_split", SPLITS)
def test_both_pipelines_train_what_one_process_trains(runs, num_split, capfd):
    losses, weights = one_process(num_split, 2)
    engines = ["rpc", "GPipe"] + (["1F1B"] if num_split == SPLITS[-1] else [])
    for engine in engines:
        args, engine_runs = runs[engine]
        run = next(r for r in engine_runs if r["num_split"] == num_split)
        where = f"{engine}, {num_split} split(s)"
        torch.testing.assert_close(run["losses"], losses, **LOSS_TOL, msg=lambda m: f"{where}: {m}")
        print_report(args, [run])  # what main() prints after the launch
        printed = printed_losses(capfd.readouterr().out, num_split)
        assert printed == pytest.approx(losses, abs=2e-4), (where, printed, losses)
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
    digests = {engine: tuple(r["init_digests"]) for engine, (_, rs) in runs.items() for r in rs}
    assert len(set(digests.values())) == 1, digests


def test_pipelining_trace_has_every_forward_and_backward_once_in_pipeline_order(runs):
    """--trace: the same per-rank timeline as main.py's (F and B of every micro-batch)."""
    args, [run] = runs["1F1B"]
    m = run["num_split"]
    paths = write_trace(args.trace, [run])  # what main() does with the runs
    assert [p.name for p in paths] == [f"splits_{m}.json", "timeline.png"]
    spans = read_chrome_trace(paths[0])
    start, end = run["windows"][-1]  # the timed batch
    got: dict[tuple, object] = {}
    for s in spans:
        if s.kind in ("F", "B") and start <= s.start <= end:
            key = (s.rank, s.stage, s.kind, s.microbatch)
            assert key not in got, f"{key} twice in one batch"
            got[key] = s
    assert set(got) == {(st, st, k, i) for st in (0, 1) for k in "FB" for i in range(m)}
    for i in range(m):
        assert got[1, 1, "F", i].start >= got[0, 0, "F", i].end
        assert got[0, 0, "B", i].start >= got[1, 1, "B", i].end


SMALL = ("--batch_size", "4", "--image_size", "32", "--num_batches", "1", "--warmup", "0",
         "--num_classes", "10", "--splits", "2")


def test_torchrun_launch_prints_the_same_lines():
    """One rank per process under torchrun, as the pipelining tutorial launches it."""
    proc = run_torchrun(2, "rpc_pipeline_resnet/pipelining.py", *SMALL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[rank 0] Processing batch 0" in proc.stdout, proc.stdout
    assert "number of splits = 2, execution time = " in proc.stdout, proc.stdout
    assert "devices: rank 0 cpu, rank 1 cpu" in proc.stdout and "loss of each batch" in proc.stdout


def readme_command(script: str) -> list[str]:
    """The first command of rpc_pipeline_resnet/README.md's code blocks that runs ``script``
    with ``python``, as argv after ``python`` (its comment dropped)."""
    text = (REPO / "rpc_pipeline_resnet" / "README.md").read_text()
    line = next(l for l in text.splitlines() if l.startswith(f"python {script}"))
    return line.split("#")[0].split()[1:]


@pytest.mark.fast  # the README's command must run on the oldest supported torch too
def test_the_readme_command_runs_on_this_torch():
    """``python rpc_pipeline_resnet/pipelining.py --world_size 2``, at small sizes: its default
    --splits are each run, or left out with one line where this PyTorch refuses them (torch
    2.10's GPipe refuses 1 micro-batch on 2 stages)."""
    argv = readme_command("rpc_pipeline_resnet/pipelining.py")
    assert "--splits" not in argv, argv  # the default list is what is checked here
    proc = run_cli(*argv, "--image_size", "32", "--num_batches", "1", "--warmup", "0",
                   "--num_classes", "10", timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    refused = {m: schedule_problem("GPipe", 2, m) for m in (1, 2, 4, 8)}
    ran = [int(n) for n in re.findall(r"number of splits = (\d+),", proc.stdout)]
    assert ran == [m for m, problem in refused.items() if problem is None], proc.stdout
    skipped = [l for l in proc.stdout.splitlines() if l.startswith("skipping --splits")]
    assert skipped == [f"skipping --splits {m}: GPipe on 2 stages: {problem} (torch "
                       f"{torch.__version__.split('+')[0]})" for m, problem in refused.items() if problem]


BAD_INPUT = [
    (["--splits", "3"], "--splits values must divide --batch_size 16"),
    (["--schedule", "1F1B", "--splits", "1", "2"], "--schedule 1F1B --splits 1: Number of microbatches (1)"),
    (["--schedule", "Interleaved1F1B"], "invalid choice: 'Interleaved1F1B'"),
    (["--world_size", "3"], "--world_size must be at most 2"),
    (["--splits", "2", "--image_size", "8", "--batch_size", "4"], "give BatchNorm"),  # main.py's check
    (["--splits", "2", "--lr", "0"], "--lr must be a positive number"),
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
