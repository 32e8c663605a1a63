"""ddp_rpc: one DDP+RPC iteration equals the single-process maths; trainers stay in sync."""
from __future__ import annotations

import argparse
import copy
import datetime
import functools
import importlib
import re
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn.functional as F
from torch.distributed.nn import RemoteModule
from torch.distributed.optim import DistributedOptimizer

import distkit
from conftest import (FLOAT32, PRINTED_4, checked_args, on_cuda_optimizer_path, refused_before_launch, run_cli,
                      run_torchrun)
from ddp_rpc.main import main, run_worker
from ddp_rpc import sharded, trainer
from ddp_rpc.report import _embedding_weight
from ddp_rpc.trainer import EMBEDDING_DIM, MAX_BAG_SIZE, NUM_CLASSES, NUM_EMBEDDINGS, TrainConfig, get_next_batch

MASTER = 2  # ranks 0 and 1 train, 2 is the master, 3 the parameter server
NUMBER = r"[-+]?\d+\.\d+"


def make_args(*argv: str) -> argparse.Namespace:
    return checked_args("ddp_rpc.main", *argv)


def test_batches_are_seeded_valid_bags_and_differ_per_trainer():
    config = TrainConfig(batches_per_epoch=3, batch_size=7, seed=5)
    first = list(get_next_batch(0, config))
    assert len(first) == 3
    for indices, offsets, target in first:
        assert offsets.shape == target.shape == (7,)
        assert offsets[0] == 0 and bool((offsets.diff() >= 1).all())
        assert offsets[-1] < len(indices)  # the last bag is not empty
        assert 0 <= indices.min() and indices.max() < NUM_EMBEDDINGS
        assert 0 <= target.min() and target.max() < NUM_CLASSES
    again = list(get_next_batch(0, config))  # every epoch replays the same batches
    other = list(get_next_batch(1, config))
    for a, b, c in zip(first, again, other):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
        assert not torch.equal(a[2], c[2])


def _reference_step(emb_before, fc_before, batches, lr):
    """One process, no RPC, no DDP: the gradient each trainer's batch gives, and the update
    the tutorial's scheme should apply (fc: averaged by DDP; table: one SGD step per trainer)."""
    emb = torch.nn.EmbeddingBag(NUM_EMBEDDINGS, EMBEDDING_DIM, mode="sum")
    with torch.no_grad():
        emb.weight.copy_(emb_before)
    fc = torch.nn.Linear(EMBEDDING_DIM, NUM_CLASSES)
    fc.load_state_dict(fc_before)
    losses, grad_emb, grad_fc = [], [], []
    for indices, offsets, target in batches:
        e, f = copy.deepcopy(emb), copy.deepcopy(fc)
        loss = F.cross_entropy(f(e(indices, offsets)), target)
        loss.backward()
        losses.append(loss.item())
        grad_emb.append(e.weight.grad)
        grad_fc.append({name: p.grad for name, p in f.named_parameters()})
    emb_after = emb_before - lr * torch.stack(grad_emb).sum(0)
    fc_after = {name: fc_before[name] - lr * torch.stack([g[name] for g in grad_fc]).mean(0)
                for name in fc_before}
    return losses, grad_fc, emb_after, fc_after


def _printed(pattern: str, output: str) -> list[float]:
    """Every number the groups of ``pattern`` catch in ``output``, in order."""
    return [float(x) for m in re.finditer(pattern, output) for x in m.groups()]


ONE_ITERATION = ["--epochs", "1", "--batches_per_epoch", "1", "--batch_size", "6", "--seed", "3", "--lr", "0.5"]


@pytest.mark.fast  # also on Python 3.10 and 3.13 (.ci/run)
def test_one_iteration_matches_single_process_maths(kept_results, capfd):
    """The RPC version's first iteration, and sharded.py's from the same --seed on as many ranks as
    trainers: the same initial weights, losses and updates (the first lookups of both trainers come
    before either step, as DDP's allreduce sits between them)."""
    # the user's command (python ddp_rpc/main.py ARGS), in this process: main's own launch,
    # kept aside for the numbers underneath, and what the run printed
    assert main(ONE_ITERATION) == 0
    printed = capfd.readouterr().out
    out = kept_results[0][MASTER]
    config, reports = out["config"], out["trainers"]
    assert [r.rank for r in reports] == [0, 1] and config.lr == 0.5
    # DDP broadcast rank 0's fc at construction (each trainer seeded its own differently)
    for name, p in reports[0].fc_before.items():
        torch.testing.assert_close(reports[1].fc_before[name], p, rtol=0, atol=0)

    batches = [next(get_next_batch(r.rank, config)) for r in reports]
    losses, grad_fc, emb_after, fc_after = _reference_step(
        out["emb_before"], reports[0].fc_before, batches, config.lr)
    # the two trainers' gradients differ, so averaging them (DDP) is visible
    assert not torch.allclose(grad_fc[0]["weight"], grad_fc[1]["weight"])

    for r, loss in zip(reports, losses):
        torch.testing.assert_close(r.losses, [[loss]], **FLOAT32)  # float32 losses, as floats
        # the loss the user reads: each trainer's log line and the master's summary (4 decimals)
        logged = _printed(rf"\[rank {r.rank}\] Training done for epoch 0: loss ({NUMBER})", printed)
        assert logged == [pytest.approx(loss, abs=PRINTED_4)], printed
        summary = _printed(rf"trainer{r.rank}: loss ({NUMBER}) \(epoch 0\) -> ({NUMBER}) \(epoch 0\)",
                           printed)
        assert summary == [pytest.approx(loss, abs=PRINTED_4)] * 2, printed
        for name, p in fc_after.items():
            torch.testing.assert_close(r.fc_after[name], p, msg=lambda m: f"trainer{r.rank} fc.{name}: {m}")
    torch.testing.assert_close(out["emb_after"], emb_after)
    assert "fc identical on all trainers: True" in printed

    assert sharded.main([*ONE_ITERATION, "--world_size", "2"]) == 0
    today = kept_results[1][0]
    torch.testing.assert_close(today["emb_before"], out["emb_before"], rtol=0, atol=0)  # the same draws
    torch.testing.assert_close(today["emb_after"], out["emb_after"], **FLOAT32)
    for r, t in zip(reports, today["trainers"]):
        torch.testing.assert_close(t.losses, r.losses, **FLOAT32)
        for name, p in r.fc_after.items():
            torch.testing.assert_close(t.fc_before[name], r.fc_before[name], rtol=0, atol=0)
            torch.testing.assert_close(t.fc_after[name], p, **FLOAT32)


def _reference_run(emb_before, fc_before, config, ranks):
    """One process over a whole run of sharded.py: at every step each rank's batch and loss; the
    table steps with the sum of their gradients (one SGD step per trainer), fc with their mean (DDP)."""
    emb = torch.nn.EmbeddingBag(NUM_EMBEDDINGS, EMBEDDING_DIM, mode="sum")
    with torch.no_grad():
        emb.weight.copy_(emb_before)
    fc = torch.nn.Linear(EMBEDDING_DIM, NUM_CLASSES)
    fc.load_state_dict(fc_before)
    opt = torch.optim.SGD([*emb.parameters(), *fc.parameters()], lr=config.lr)
    losses = [[[] for _ in range(config.epochs)] for _ in range(ranks)]
    for epoch in range(config.epochs):
        for batches in zip(*[get_next_batch(r, config) for r in range(ranks)]):
            opt.zero_grad()
            step = [F.cross_entropy(fc(emb(indices, offsets)), target) for indices, offsets, target in batches]
            torch.stack(step).sum().backward()
            for p in fc.parameters():
                p.grad /= ranks
            opt.step()
            for r, loss in enumerate(step):
                losses[r][epoch].append(loss.item())
    return losses, emb.weight.detach(), fc.state_dict()


SHARDED_RUN = ["--world_size", "3", "--epochs", "3", "--batches_per_epoch", "2", "--batch_size", "5", "--seed", "2",
               "--lr", "0.5"]


@pytest.mark.parametrize("optimizer_step", ["cpu_default", "cuda_default"])
def test_sharded_trains_what_one_process_trains(optimizer_step, kept_results):
    """sharded.py on 3 ranks (100 rows: 34, 33, 33), several epochs: every rank's loss at every step,
    the whole table and fc at the end, as one process computes them. With the optimizer step each device
    takes by default: the CPU's one tensor at a time (the user's command), CUDA's foreach (one
    list of fc's tensors and the table's DTensor crashed there)."""
    if optimizer_step == "cpu_default":
        assert sharded.main(SHARDED_RUN) == 0
        out = kept_results[0][0]
    else:
        run_worker = functools.partial(on_cuda_optimizer_path, sharded.run_worker)
        out = distkit.launch(run_worker, checked_args("ddp_rpc.sharded", *SHARDED_RUN, "--threads", "1"))[0]
    reports = out["trainers"]
    losses, emb_after, fc_after = _reference_run(out["emb_before"], reports[0].fc_before, out["config"], 3)
    assert not torch.equal(out["emb_after"], out["emb_before"])
    torch.testing.assert_close(out["emb_after"], emb_after, **FLOAT32)
    for r, report in enumerate(reports):
        torch.testing.assert_close(report.losses, losses[r], **FLOAT32)
        for name, p in fc_after.items():
            torch.testing.assert_close(report.fc_after[name], p, **FLOAT32)
    assert sum(losses[0][-1]) < sum(losses[0][0])  # it learns


def test_pad_bags_holds_every_bag_in_order():
    indices, offsets = torch.tensor([5, 6, 7, 8, 9, 10]), torch.tensor([0, 1, 1, 4])  # bag 1 is empty
    padded, mask = sharded.pad_bags(indices, offsets)
    assert padded.shape == mask.shape == (4, MAX_BAG_SIZE)
    assert padded[mask].tolist() == indices.tolist() and mask.sum(1).tolist() == [1, 0, 3, 2]


def test_training_keeps_trainers_in_sync_and_lowers_loss():
    args = make_args("--epochs", "4", "--batches_per_epoch", "3", "--batch_size", "8", "--seed", "1")
    out = distkit.launch(run_worker, args)[MASTER]
    first, second = out["trainers"]
    for name, p in first.fc_after.items():
        torch.testing.assert_close(second.fc_after[name], p, rtol=0, atol=0)  # DDP kept them in sync
        assert not torch.equal(p, first.fc_before[name])
    assert not torch.equal(out["emb_after"], out["emb_before"])
    for r in (first, second):
        assert len(r.losses) == 4 and all(len(epoch) == 3 for epoch in r.losses)
        assert sum(r.losses[-1]) < sum(r.losses[0]), r.losses  # same batches every epoch: learnt


BATCH_SECONDS = 1.0  # each trainer's batches this far apart: a run several times --hang_timeout long


def _slow_batches_worker(rank: int, args: argparse.Namespace) -> None:
    """run_worker, whose trainers get their batches ``BATCH_SECONDS`` apart, and whose master counts
    the end of its set-up as progress: from there, its bound is --hang_timeout (120 s before any)."""
    from ddp_rpc import main as example

    if rank < example.num_trainers(args.world_size):
        batches = trainer.get_next_batch

        def slow(rank: int, config: TrainConfig):
            for batch in batches(rank, config):
                time.sleep(BATCH_SECONDS)
                yield batch

        trainer.get_next_batch = slow
    elif rank == MASTER:
        wait = example.wait_for_trainers

        def set_up_done(*given, **named):
            distkit.progress()
            return wait(*given, **named)

        example.wait_for_trainers = set_up_done
    example.run_worker(rank, args)


def test_the_master_waits_longer_than_hang_timeout_its_pings_counted():
    """The master only waits on the trainers: their answers to its pings are its progress, so a run
    longer than --hang_timeout (8 s at 5 s) ends normally."""
    args = make_args("--epochs", "1", "--batches_per_epoch", "8", "--batch_size", "4", "--hang_timeout", "5",
                     "--threads", "1")
    out = distkit.launch(_slow_batches_worker, args)[MASTER]
    assert out["seconds"] > 8 * BATCH_SECONDS > args.hang_timeout
    assert [len(r.losses[0]) for r in out["trainers"]] == [8, 8]


# the default run (the README's command): tests/test_quiet_output.py


def test_torchrun_launch():
    proc = run_torchrun(4, "ddp_rpc/main.py", "--epochs", "2", "--batches_per_epoch", "2",
                        timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[rank 1] Training done for epoch 1: loss " in proc.stdout
    assert "fc identical on all trainers: True" in proc.stdout


def test_bad_input_is_one_line_exit_2():
    """As a shell sees it (the other cases in-process, below)."""
    proc = run_cli("ddp_rpc/main.py", "--world_size", "2", timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "--world_size must be at least 3" in proc.stderr, proc.stderr
    assert "[rank" not in proc.stdout  # nothing was spawned


@pytest.mark.parametrize("argv, message", [
    (["--epochs", "ten"], "argument --epochs: invalid int value: 'ten'"),
    (["--epochs", "0"], "argument --epochs: must be at least 1, got 0"),
    (["--batches_per_epoch", "0"], "argument --batches_per_epoch: must be at least 1, got 0"),
    (["--batch_size", "-4"], "argument --batch_size: must be at least 1, got -4"),
    (["--lr", "0"], "argument --lr: must be a positive number, got 0.0"),
    (["--lr", "nan"], "argument --lr: must be a positive number, got nan"),
    (["--seed", "-1"], "argument --seed: must be at least 0, got -1"),
    (["--device", "cuda"], "--device cuda was asked for, but no CUDA device is visible"),  # tests hide the GPUs
])
def test_bad_values_rejected_before_launch(argv, message, capsys, monkeypatch):
    # in-process (the same parser.error path as above, without paying a Python start-up)
    assert message in refused_before_launch(main, argv, capsys, monkeypatch)


# ---- concurrent steps on the parameter server lose no update ----

ROWS, DIM, CLIENTS, STEPS = 1000, 256, 8, 25  # a 1 MB table: an update takes long enough to overlap


def _zeroed_weight(module_rref) -> torch.Tensor:
    """On the parameter server: zero the table (exact sums below), return a copy."""
    weight = module_rref.local_value().weight
    with torch.no_grad():
        weight.zero_()
    return weight.detach().clone()


class OverlapWatch:
    """Wraps torch's SGD update on the parameter server: counts updates running at once.

    Whether two unserialised in-place updates really interleave (and lose one) depends on
    thread timing; a short sleep inside every update makes unserialised ones overlap for sure.
    """

    def __init__(self) -> None:
        self.lock, self.inside, self.most = threading.Lock(), 0, 0

    def wrap(self, real):
        def sgd(*args, **kwargs):
            with self.lock:
                self.inside += 1
                self.most = max(self.most, self.inside)
            try:
                time.sleep(0.002)
                return real(*args, **kwargs)
            finally:
                with self.lock:
                    self.inside -= 1
        return sgd


WATCH = OverlapWatch()


def _most_updates_at_once() -> int:
    return WATCH.most


def _many_trainers_worker(rank: int, args: argparse.Namespace) -> dict | None:
    """Rank 1 is the parameter server; rank 0 runs CLIENTS trainer threads, each with its own
    DistributedOptimizer (as every trainer of the example has), stepping one shared table."""
    options = rpc.TensorPipeRpcBackendOptions(rpc_timeout=60)
    if rank == 1:
        # both paths DistributedOptimizer may take: the functional SGD and optim.SGD's step
        for name in ("torch.optim._functional", "torch.optim.sgd"):
            module = importlib.import_module(name)
            module.sgd = WATCH.wrap(module.sgd)
        rpc.init_rpc("ps", rank=1, world_size=2, rpc_backend_options=options)
        rpc.shutdown()
        return None
    rpc.init_rpc("trainer0", rank=0, world_size=2, rpc_backend_options=options)
    table = RemoteModule("ps", torch.nn.EmbeddingBag, args=(ROWS, DIM), kwargs={"mode": "sum"})
    rpc.rpc_sync("ps", _zeroed_weight, args=(table.get_module_rref(),))
    # one bag of every row, loss = its sum: every step's gradient is exactly 1 everywhere,
    # whatever the table holds, so the table must end at exactly -lr * CLIENTS * STEPS
    indices, offsets = torch.arange(ROWS), torch.tensor([0])

    def trainer_thread() -> None:
        opt = DistributedOptimizer(trainer.SerializedSGD, table.remote_parameters(), lr=1.0)
        for _ in range(STEPS):
            with dist_autograd.context() as context_id:
                dist_autograd.backward(context_id, [table.forward(indices, offsets).sum()])
                opt.step(context_id)

    threads = [threading.Thread(target=trainer_thread) for _ in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = rpc.rpc_sync("ps", _embedding_weight, args=(table.get_module_rref(),))
    most = rpc.rpc_sync("ps", _most_updates_at_once)
    rpc.shutdown()
    return {"after": after, "most_at_once": most}


def test_run_trainer_builds_the_optimizer_tested_below():
    # the test below checks SerializedSGD: _run_trainer must build its DistributedOptimizer
    # from that class, not from optim.SGD (whose steps on the table are not serialised)
    names = trainer._run_trainer.__code__.co_names
    assert "DistributedOptimizer" in names and "SerializedSGD" in names, names
    assert "SGD" not in names, names


def test_concurrent_optimizer_steps_on_the_table_lose_no_update():
    args = make_args("--threads", "1")
    args.world_size = 2  # a trainer process and the parameter server
    out = distkit.launch(_many_trainers_worker, args)[0]
    assert out["most_at_once"] == 1, f"{out['most_at_once']} updates of the table ran at once"
    after = out["after"]
    lost = int((after != -float(CLIENTS * STEPS)).sum())
    assert lost == 0, f"{lost} of {after.numel()} table entries lost an update"


@pytest.mark.parametrize("module, argv, message", [
    ("ddp_rpc.sharded", ["--world_size", "0"], "--world_size must be at least 1"),
    ("ddp_rpc.sharded", ["--batch_size", "0"], "argument --batch_size: must be at least 1, got 0"),
    ("ddp_rpc.sharded", ["--device", "cuda"], "--device cuda was asked for, but no CUDA device is visible"),
    ("ddp_rpc.sharded", ["--world_size", "101"], "--world_size 101 is more ranks than the table has rows (100)"),
    ("rpc_rnn.sharded", ["--world_size", "4", "--ntoken", "3"], "--world_size 4 is more ranks than --ntoken 3"),
    ("rpc_rnn.sharded", ["--world_size", "0"], "--world_size must be at least 1"),
    ("rpc_rnn.sharded", ["--ntoken", "1"], "argument --ntoken: must be at least 2, got 1"),
    ("rpc_rnn.sharded", ["--device", "cuda"], "--device cuda was asked for, but no CUDA device is visible"),
])
def test_the_sharded_versions_refuse_bad_input_before_launch(module, argv, message, capsys, monkeypatch):
    """Both sharded.py files: their own launch checks, main.py's training flags, their placement."""
    assert message in refused_before_launch(importlib.import_module(module).main, argv, capsys, monkeypatch)


@pytest.mark.fast
def test_a_trainer_builds_its_model_on_the_gpu_its_group_is_bound_to(monkeypatch):
    """On a GPU machine run_worker binds the trainers' group to the trainer's GPU (``device_id``), and
    _run_trainer, called by the master in one of RPC's threads, builds its model there: the group's
    ``bound_device_id``, not the thread's current CUDA device (cuda:0 in every new thread)."""
    from types import SimpleNamespace

    seen = []

    def model_on(remote_emb_module, device):
        seen.append(device)
        raise RuntimeError("built")

    def group_bound_to(device):  # trainer.py's torch.distributed, as far as _run_trainer reads it
        return SimpleNamespace(group=SimpleNamespace(WORLD=SimpleNamespace(bound_device_id=device)))

    monkeypatch.setattr(trainer, "dist", group_bound_to(torch.device("cuda", 1)))
    monkeypatch.setattr(trainer, "HybridModel", model_on)
    with pytest.raises(RuntimeError, match="built"):
        trainer._run_trainer(None, 1, TrainConfig())
    assert seen == [torch.device("cuda", 1)]
    monkeypatch.setattr(trainer, "dist", group_bound_to(None))
    with pytest.raises(RuntimeError, match="built"):
        trainer._run_trainer(None, 1, TrainConfig())
    assert seen[-1] == torch.device("cpu")  # gloo on the CPU: no device bound


def fake_gpus(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """``torch.accelerator`` sees ``n`` CUDA GPUs (through ``torch.cuda``), on any build of torch."""
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *_, **__: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


@pytest.mark.fast
def test_a_gpu_trainer_joins_its_group_bound_to_its_gpu(monkeypatch):
    """run_worker's trainer 1 on a machine with a GPU per trainer makes cuda:1 current and binds its
    group to it (``device_id``, what _run_trainer reads back) with NCCL; on a machine without, gloo
    and no device. Both join through the trainers' own rendezvous: the launcher's store at
    MASTER_ADDR:MASTER_PORT, under their prefix."""
    from ddp_rpc import main as example

    # the store the launcher hosts (distkit.prepare_spawn, or torchrun's agent), here
    launcher = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(launcher.port))
    calls, set_to = [], []

    def init_process_group(**kwargs):  # the call as run_worker writes it, then no further
        calls.append(kwargs)
        raise RuntimeError("joined")

    monkeypatch.setattr(example.distkit, "start_rank", lambda rank, args: None)  # this process stays the test's
    monkeypatch.setattr(torch.accelerator, "set_device_index", set_to.append)
    monkeypatch.setattr(example.dist, "init_process_group", init_process_group)
    args = checked_args("ddp_rpc.main", "--world_size", "4")
    for gpus in (2, 0):
        fake_gpus(monkeypatch, gpus)
        with pytest.raises(RuntimeError, match="joined"):
            example.run_worker(1, args)
    gpu, cpu = calls
    store = gpu.pop("store")
    assert gpu == {"backend": "nccl", "rank": 1, "world_size": 2, "device_id": torch.device("cuda", 1),
                   "timeout": datetime.timedelta(seconds=args.rpc_timeout)}
    assert set_to == [torch.device("cuda", 1)]
    assert cpu["backend"] == "gloo" and cpu["device_id"] is None and cpu["world_size"] == 2
    # the trainers' keys land in the launcher's store, apart from RPC's
    store.set("seen", "trainer1")
    assert launcher.get("trainers/seen") == b"trainer1"
