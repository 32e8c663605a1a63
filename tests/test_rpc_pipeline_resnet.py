"""rpc_pipeline_resnet: the pipelined model computes what the two shards compute in one process.

One three-process job (master + two shard workers, tiny images, 10 classes) runs a training
step and two eval-mode forwards; the tests compare what it returns against single-process
copies of the shards built from the same initial weights.
"""
from __future__ import annotations

import argparse
import json
import re
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn as nn
import torch.optim as optim
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef
from torch.multiprocessing.spawn import ProcessRaisedException

import distkit
from conftest import (Here, checked_args, keep_weights, refused_before_launch, run_cli, run_torchrun, saved_result,
                      state_copy)
import rpc_pipeline_resnet.main as example
from rpc_pipeline_resnet.main import (WORKERS, feature_size,
                                      main, run_worker)
from rpc_pipeline_resnet.model import DistResNet50, ResNetShard1, ResNetShard2

NUM_CLASSES, BATCH = 10, 7
IMAGE = 48  # layer4 is 2x2: BatchNorm of a 2-image micro-batch sees 8 values, not 2
TRAIN_SPLIT = 3  # micro-batches of 3, 2 and 2 images
EVAL_SPLITS = (1, 4)
LR = 0.05
# Workers and reference all run one intra-op thread: BatchNorm over tiny micro-batches
# amplifies the rounding differences other thread counts bring (0.5 on the logits, measured).
# What is left differs only in the order gradients are summed.
TOL = {"rtol": 1e-4, "atol": 1e-6}


def make_args(*argv: str) -> argparse.Namespace:
    return checked_args("rpc_pipeline_resnet.main", *argv)


def _grads(module_rref: RRef, context_id: int) -> dict[str, torch.Tensor]:
    """On a shard's owner: the gradients dist_autograd accumulated for it in this context."""
    grads = dist_autograd.get_gradients(context_id)
    return {name: grads[p].cpu() if p in grads else None
            for name, p in module_rref.local_value().named_parameters()}


def _pipeline_worker(rank: int, args: argparse.Namespace) -> dict | None:
    if rank != 0:
        run_worker(rank, args)  # a shard host, exactly as in the example
        return None
    rpc.init_rpc("master", rank=0, world_size=args.world_size,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(rpc_timeout=args.rpc_timeout,
                                                                     _transports=["uv"]))
    model = DistResNet50(TRAIN_SPLIT, WORKERS, ("cpu", "cpu"), num_classes=NUM_CLASSES)
    shards = (model.p1_rref, model.p2_rref)
    fetch = lambda fn, *a: [rpc.rpc_sync(r.owner(), fn, args=(r, *a)) for r in shards]  # noqa: E731
    gen = torch.Generator().manual_seed(1)
    inputs = torch.randn(BATCH, 3, IMAGE, IMAGE, generator=gen)
    labels = torch.zeros(BATCH, NUM_CLASSES).scatter_(
        1, torch.randint(0, NUM_CLASSES, (BATCH, 1), generator=gen), 1)

    before = fetch(state_copy)
    with dist_autograd.context() as context_id:
        # the very first forward of a fresh model: before anything else used the RRefs'
        # proxies (parameter_rrefs does), rpc_async() used to lose the autograd context
        outputs = model(inputs)
        loss = nn.MSELoss()(outputs, labels)
        dist_autograd.backward(context_id, [loss])
        grads = fetch(_grads, context_id)
        opt = DistributedOptimizer(optim.SGD, model.parameter_rrefs(), lr=LR)
        opt.step(context_id)
    after = fetch(state_copy)

    model.eval()
    eval_outputs = {}
    for k in EVAL_SPLITS:
        model.num_split = k
        eval_outputs[k] = model(inputs)
    after_eval = fetch(state_copy)
    rpc.shutdown()
    return {"inputs": inputs, "labels": labels, "before": before, "outputs": outputs,
            "loss": loss.detach(), "grads": grads, "after": after, "eval": eval_outputs,
            "after_eval": after_eval}


@pytest.fixture(scope="module")
def job() -> dict:
    return distkit.launch(_pipeline_worker, make_args("--world_size", "3", "--threads", "1"))[0]


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def local_shards(states: list[dict]) -> tuple[ResNetShard1, ResNetShard2]:
    s1, s2 = ResNetShard1("cpu", num_classes=NUM_CLASSES), ResNetShard2("cpu", num_classes=NUM_CLASSES)
    s1.load_state_dict(states[0])
    s2.load_state_dict(states[1])
    return s1, s2


def local_forward(s1: ResNetShard1, s2: ResNetShard2, inputs: torch.Tensor, k: int) -> torch.Tensor:
    return torch.cat([s2(Here(s1(Here(x)))) for x in inputs.tensor_split(k)])


@pytest.mark.fast  # also on Python 3.10 and 3.13 (.ci/run)
def test_train_step_matches_single_process_reference(job, one_thread):
    torch.manual_seed(0)  # the shards' random init is overwritten by load_state_dict
    s1, s2 = local_shards(job["before"])
    # BatchNorm normalises each micro-batch by its own statistics, so the reference must
    # feed the same micro-batches, not the whole batch at once
    outputs = local_forward(s1, s2, job["inputs"], TRAIN_SPLIT)
    loss = nn.MSELoss()(outputs, job["labels"])
    torch.testing.assert_close(job["outputs"], outputs.detach(), **TOL)
    torch.testing.assert_close(job["loss"], loss.detach(), **TOL)

    loss.backward()
    for shard, grads in zip((s1, s2), job["grads"]):
        missing = [name for name, grad in grads.items() if grad is None]
        assert not missing, f"no distributed gradient for {missing}"
        for name, p in shard.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, **TOL, msg=lambda m: f"grad {name}: {m}")

    optim.SGD([*s1.parameters(), *s2.parameters()], lr=LR).step()
    for shard, after in zip((s1, s2), job["after"]):
        for name, p in shard.named_parameters():
            torch.testing.assert_close(after[name], p.detach(), **TOL, msg=lambda m: f"{name}: {m}")


def test_parameters_change_and_batchnorm_sees_micro_batches(job):
    for before, after in zip(job["before"], job["after"]):
        moved = [name for name in before if before[name].is_floating_point()
                 and "running" not in name and not torch.equal(before[name], after[name])]
        params = [name for name in before if before[name].is_floating_point() and "running" not in name]
        assert moved == params, f"unchanged after the step: {sorted(set(params) - set(moved))}"
        counts = {v.item() for k, v in after.items() if k.endswith("num_batches_tracked")}
        assert counts == {TRAIN_SPLIT}, "every BatchNorm should count one update per micro-batch"


@pytest.mark.fast  # also on Python 3.10 and 3.13 (.ci/run)
@pytest.mark.parametrize("k", EVAL_SPLITS)
def test_eval_forward_matches_shards_in_one_process(job, k, one_thread):
    # eval mode reached the workers: the forwards left BatchNorm's statistics alone
    for after, after_eval in zip(job["after"], job["after_eval"]):
        for name in after:
            assert torch.equal(after[name], after_eval[name]), name
    s1, s2 = local_shards(job["after"])
    s1.eval()
    s2.eval()
    with torch.no_grad():
        expected = local_forward(s1, s2, job["inputs"], 1)
    assert job["eval"][k].shape == (BATCH, NUM_CLASSES)
    torch.testing.assert_close(job["eval"][k], expected, **TOL)


def _kept_worker(rank: int, args: argparse.Namespace) -> dict | None:
    """The example's run_worker, as main() launches it (so its run_master, the tutorial's
    loop, and --trace's profiler, which its first line starts), with the shards' weights kept
    before the first batch and after the last."""
    kept = keep_weights(example, "run_master")
    runs = saved_result(run_worker, rank, args)
    return {"runs": runs, "weights": kept} if runs is not None else None


SLOW = 8.0  # seconds shard 2 takes over the second batch, above --hang_timeout 5


def _busy_shards_worker(rank: int, args: argparse.Namespace) -> None:
    """run_worker, with shard 2's second forward SLOW s long; the shards count every moment as
    progress (as a busy shard's layers would), so only the master's own bound is tried."""
    if rank != 0:
        def busy() -> None:
            while True:
                distkit.progress()
                time.sleep(0.2)

        threading.Thread(target=busy, daemon=True).start()
        forward, calls = ResNetShard2.forward, []

        def slow_forward(self: ResNetShard2, x_rref: RRef) -> torch.Tensor:
            calls.append(None)
            if len(calls) == 2:
                time.sleep(SLOW)
            return forward(self, x_rref)

        ResNetShard2.forward = slow_forward
    run_worker(rank, args)


def test_the_master_waits_longer_than_hang_timeout_its_pings_counted():
    """The master only waits while its shards compute: their answers to its pings are its
    progress, so a batch longer than --hang_timeout (8 s at 5 s) ends normally."""
    args = make_args("--world_size", "3", "--threads", "1", "--batch_size", "4", "--image_size", "32",
                     "--num_classes", "10", "--splits", "1", "--num_batches", "2", "--hang_timeout", "5")
    runs = distkit.launch(_busy_shards_worker, args)[0]
    assert len(runs) == 1 and len(runs[0]["losses"]) == 2
    assert runs[0]["time"] > SLOW > args.hang_timeout


def test_a_diverging_run_stops_with_an_error():
    """A loss that turns non-finite ends the job (exit 1) naming the batch, not a printed nan."""
    args = make_args("--world_size", "3", "--threads", "1", "--batch_size", "4",
                     "--image_size", "32", "--num_classes", "10", "--splits", "2",
                     "--num_batches", "2", "--lr", "1e30")
    with pytest.raises(ProcessRaisedException) as failure:  # mp.spawn's report: the master's traceback
        distkit.launch(run_worker, args)
    assert failure.value.error_index == 0
    message = str(failure.value)
    assert re.search(r"FloatingPointError: the loss is (nan|inf) at batch \d with 2 splits", message), message


def test_feature_size_matches_the_model():
    s1, s2 = ResNetShard1("cpu", num_classes=2).eval(), ResNetShard2("cpu", num_classes=2).eval()
    with torch.no_grad():
        for size in (32, 33, 40):
            features = s2.seq[:2](s1.seq(torch.zeros(1, 3, size, size)))
            assert features.shape[-1] == feature_size(size, 5), size


SMALL = ("--batch_size", "4", "--image_size", "32", "--num_batches", "1",
         "--num_classes", "10", "--splits", "1", "2")


# the CLI's lines for every split: tests/test_quiet_output.py; --trace's files: the traced run below


def test_torchrun_launch():
    """One rank a process, as torchrun starts them: the master's process prints the tutorial's lines."""
    proc = run_torchrun(3, "rpc_pipeline_resnet/main.py", *SMALL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "number of splits = 2, execution time = " in proc.stdout


BAD_INPUT = [
    (["--batch_size", "4", "--splits", "1", "8"], "--splits values must be in 1..4"),
    (["--splits", "0"], "argument --splits: must be at least 1, got 0"),
    (["--splits", "2", "-1"], "argument --splits: must be at least 1, got -1"),
    (["--image_size", "-64"], "argument --image_size: must be at least 1, got -64"),
    (["--batch_size", "0"], "argument --batch_size: must be at least 1, got 0"),
    (["--num_batches", "0"], "argument --num_batches: must be at least 1, got 0"),
    (["--warmup", "1"], "unrecognized arguments: --warmup 1"),  # the benchmark's flag, not the example's
    (["--lr", "0"], "argument --lr: must be a positive number, got 0.0"),
    (["--lr", "nan"], "argument --lr: must be a positive number, got nan"),
    (["--batch_size", "4", "--image_size", "32", "--splits", "4"],
     "give BatchNorm 4 value(s) per channel in layer3 and 1"),
    (["--image_size", "8", "--splits", "8"], "give BatchNorm 2 value(s) per channel in layer3 and 2"),
    (["--world_size", "2"], "--world_size must be at least 3"),
    (["--splits"], "expected at least one argument"),
]


@pytest.mark.parametrize("argv, message", BAD_INPUT)
def test_bad_input_is_rejected_before_launch(argv, message, capsys, monkeypatch):
    err = refused_before_launch(main, argv, capsys, monkeypatch)
    assert message in err, err


@pytest.mark.parametrize("argv, message", [BAD_INPUT[0]])  # as a shell sees it; the rest in-process
def test_bad_input_cli_is_one_line_exit_2(argv, message):
    proc = run_cli("rpc_pipeline_resnet/main.py", *argv, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
    assert "[rank" not in proc.stdout  # nothing was spawned


# --- seeds and traces: the example's own run_worker, two split values, --trace ---------------
TRACE_SPLITS, TRACE_BATCHES = (1, 3), 2


@pytest.fixture(scope="module")
def traced(tmp_path_factory) -> tuple[dict, Path]:
    """run_worker exactly as main() launches it; 6 images of 32x32 (micro-batches of 2 at 3 splits)."""
    args = make_args("--splits", *map(str, TRACE_SPLITS), "--batch_size", "6", "--image_size", "32",
                     "--num_batches", str(TRACE_BATCHES), "--num_classes", "10",
                     "--trace", str(tmp_path_factory.mktemp("trace")))
    return distkit.launch(_kept_worker, args)[0], Path(args.trace)


def test_every_split_value_starts_from_the_same_weights(traced):
    kept, _ = traced
    # the same weights for every split value (the workers' global generators have moved on
    # between the runs: without the seed they differ), and the two shards differ
    first, second = (run["before"] for run in kept["weights"])
    for a, b in zip(first, second):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert first[0].keys() != first[1].keys()


def test_seed_fixes_the_weights_whatever_ran_before():
    a = ResNetShard1("cpu", num_classes=2, seed=3).state_dict()
    torch.randn(100)  # the global generator moves on
    same = ResNetShard1("cpu", num_classes=2, seed=3).state_dict()
    other = ResNetShard1("cpu", num_classes=2, seed=4).state_dict()
    assert all(torch.equal(a[k], same[k]) for k in a)
    assert not torch.equal(a["seq.0.weight"], other["seq.0.weight"])


def test_trace_is_each_ranks_profile_with_every_split_and_the_shards_work(traced):
    """--trace: torch.profiler's Chrome trace of every rank, from run_worker's first line
    (distkit.start_rank) to the rank's end. The master's has every batch's loss, of every split
    value; each shard's has its convolutions, which run on the RPC agent's threads (the profiler
    records them only when asked for every thread: distkit/profiling.py)."""
    _, trace_dir = traced
    events = {rank: json.loads((trace_dir / f"rank{rank}.json").read_text())["traceEvents"]
              for rank in range(3)}
    names = {rank: {e.get("name") for e in evs} for rank, evs in events.items()}
    losses = [e for e in events[0] if e.get("name") == "aten::mse_loss"]
    assert len(losses) == len(TRACE_SPLITS) * TRACE_BATCHES, [e.get("name") for e in events[0]][:50]
    for rank in (1, 2):  # the shard's main thread only waits in rpc.shutdown()
        assert "aten::convolution" in names[rank], f"rank {rank}: no convolution in its profile"
