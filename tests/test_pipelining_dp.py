"""pipelining_transformer --dp_size: pipeline replicas on a ("dp", "pp") mesh equal one process;
a checkpoint saved by replicas loads into one pipeline and into one process; bad shapes are refused.

One launch per layout: its workers run several (schedule, split) pairs in turn on a tiny
model, each one step from the same seeded weights, and return what each rank computed.
"""
from __future__ import annotations

import argparse
import copy
import functools
import json
import re

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.multiprocessing.spawn import ProcessException

import distkit
from conftest import PRINTED_4, checked_args, on_cuda_optimizer_path, refused_before_launch, run_cli
from pipelining_recorded import train_recorded
from distkit.schedules import SCHEDULES
from pipelining_transformer import checkpoint
from pipelining_transformer.train import init_distributed, main, model_args_from
from pipelining_transformer.model import Transformer, make_optimizer, synthetic_batch, tokenwise_loss_fn

# dropout 0 and SGD, as in test_pipelining_transformer.py (same reasons); 16 rows: 2 replicas
# x 4 micro-batches of 2 rows
TINY = ("--dim", "32", "--n_heads", "2", "--vocab_size", "64", "--seq_len", "8", "--n_layers", "4",
        "--batch_size", "16", "--n_microbatches", "4", "--dropout", "0", "--seed", "5")
SGD = ("--optimizer", "sgd", "--lr", "0.1")
# (world size, dp size) -> the (schedule, split) runs: every schedule with the manual split,
# the tracer split with a V-shaped one (tracing costs seconds per rank)
RUNS = {
    (4, 2): [(s, "manual") for s in SCHEDULES] + [("ZBVZeroBubble", "tracer")],
    (2, 2): [("GPipe", "manual"), ("ZBVZeroBubble", "manual")],  # dp=2 x pp=1: 1 or 2 stages a rank
}


def make_args(*argv: str) -> argparse.Namespace:
    return checked_args("pipelining_transformer.train", *argv)


def _whole(t: torch.Tensor | None) -> torch.Tensor | None:
    """A tensor as one process holds it: a dp-sharded one gathered (a collective of its group)."""
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return None if t is None else t.detach().cpu().clone()


def _dp_worker(rank: int, args: argparse.Namespace) -> dict:
    """One step of the example's own loop (``train.train``) per (schedule, split) in args.runs."""
    env = init_distributed(rank, args)
    out = {"dp_rank": env.dp_rank, "pp_rank": env.pp_rank}
    for schedule, split in args.runs:
        run_args = argparse.Namespace(**{**vars(args), "schedule": schedule, "split": split})
        out[(schedule, split)] = train_recorded(run_args, env, whole=_whole)
        dist.barrier()  # no run's messages can meet the next run's
    dist.destroy_process_group()
    return out


@functools.cache
def _launch(world_size: int, dp_size: int) -> tuple[argparse.Namespace, dict | str]:
    layout = ("--world_size", str(world_size), "--dp_size", str(dp_size))
    runs = RUNS[(world_size, dp_size)]
    args = make_args(*TINY, *SGD, *layout, "--steps", "1")
    for schedule, _ in runs:  # every run is one the CLI would accept
        make_args(*TINY, *SGD, *layout, "--schedule", schedule)
    args.runs = runs
    try:
        return args, distkit.launch(_dp_worker, args)
    except ProcessException as e:  # mp.spawn's report, with the failed rank's traceback
        return args, f"the launch failed: {e}"


@functools.cache
def _reference(optimizer: tuple[str, ...] = SGD) -> dict:
    """The full model in this one process, on the whole batch: same seed, data and optimizer."""
    args = make_args(*TINY, *optimizer)
    torch.manual_seed(args.seed)
    model = copy.deepcopy(Transformer(model_args_from(args)))
    x, y = synthetic_batch(0, args.batch_size, args.seq_len, args.vocab_size, args.seed)
    out = model(x)
    loss = tokenwise_loss_fn(out, y)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    make_optimizer(args.optimizer, model.parameters(), args.lr).step()
    return {"loss": loss.detach(), "out": out.detach(), "y": y, "grads": grads,
            "params": dict(model.named_parameters())}


@pytest.mark.parametrize("world_size, dp_size, schedule, split",
                         [(w, d, s, split) for (w, d), runs in RUNS.items() for s, split in runs])
def test_dp_x_pp_step_equals_single_process(world_size, dp_size, schedule, split):
    args, results = _launch(world_size, dp_size)
    assert not isinstance(results, str), results
    ref = _reference()
    # rank = dp_rank * pp_size + pp_rank: each replica is a block of consecutive ranks
    pp_size = world_size // dp_size
    assert {r: (res["dp_rank"], res["pp_rank"]) for r, res in results.items()} == {
        r: divmod(r, pp_size) for r in range(world_size)}
    per_rank = {r: res[(schedule, split)] for r, res in results.items()}

    # each replica's last stage reports its own micro-batches: replica k's are the k-th
    # dp_size-th of the whole batch's, cut as one pipeline of dp_size x as many would cut it
    reporting = sorted((results[r]["dp_rank"], r) for r, res in per_rank.items()
                       if res["losses"] is not None)
    assert [d for d, _ in reporting] == list(range(dp_size)), "one last stage per replica"
    got = torch.cat([per_rank[r]["losses"] for _, r in reporting])
    n_mb = dp_size * args.n_microbatches
    expected = torch.stack([tokenwise_loss_fn(o, t) for o, t in
                            zip(ref["out"].chunk(n_mb), ref["y"].chunk(n_mb))])
    torch.testing.assert_close(got, expected)
    for _, r in reporting:  # the batch's loss: the whole batch's, on every replica
        torch.testing.assert_close(torch.tensor(per_rank[r]["batch_loss"]), ref["loss"])
    # what the user reads: replica 0's last stage prints it and logs it at full precision
    printed = {r: res["printed"] for r, res in per_rank.items() if res["printed"]}
    first_reporting = reporting[0][1]
    assert list(printed) == [first_reporting] and len(printed[first_reporting]) == 1, printed
    shown = re.fullmatch(r"step 1/1  loss (\d+\.\d{4})", printed[first_reporting][0])
    assert shown and float(shown[1]) == pytest.approx(float(ref["loss"]), abs=PRINTED_4), printed
    logged = {r: res["loss_log"] for r, res in per_rank.items() if res["loss_log"] is not None}
    assert list(logged) == [first_reporting], logged
    torch.testing.assert_close(torch.tensor(logged[first_reporting][0]["loss"]), ref["loss"])

    # every rank of every replica ends with the whole batch's gradients and update
    for r, res in per_rank.items():
        for name, g in res["grads"].items():
            assert g is not None, f"rank {r}: {name} got no gradient"
            torch.testing.assert_close(g, ref["grads"][name], msg=lambda m: f"rank {r}, grad of {name}: {m}")
            torch.testing.assert_close(res["params"][name], ref["params"][name],
                                       msg=lambda m: f"rank {r}, {name} after the step: {m}")
    # a replica's stages hold every parameter of the model once
    for d in range(dp_size):
        names = [n for r in range(d * pp_size, (d + 1) * pp_size) for n in per_rank[r]["grads"]]
        assert sorted(names) == sorted(ref["grads"])


@pytest.mark.parametrize("optimizer", [SGD, ("--optimizer", "adamw", "--lr", "3e-3")])
def test_sharded_replicas_step_as_on_cuda(optimizer):
    """FSDP2's DTensor parameters (--dp_size 2), stepped by pipelining's SGD and AdamW as on CUDA by
    default (foreach), end the step with one process's weights."""
    args = make_args(*TINY, *optimizer, "--world_size", "2", "--dp_size", "2", "--steps", "1", "--threads", "1")
    args.runs = [("GPipe", "manual")]
    results = distkit.launch(functools.partial(on_cuda_optimizer_path, _dp_worker), args)
    ref, lr = _reference(optimizer), float(optimizer[-1])
    for r, res in results.items():
        for name, p in res[("GPipe", "manual")]["params"].items():
            # AdamW's first step moves each weight by about lr * sign(gradient): where the gradient is
            # rounding noise (the attention's key bias: 0 in exact arithmetic), either sign is right
            noise = ref["grads"][name].abs() < 1e-6
            torch.testing.assert_close(p[~noise], ref["params"][name][~noise], msg=lambda m: f"rank {r}, {name}: {m}")
            assert bool(((p - ref["params"][name]).abs()[noise] <= 2.01 * lr).all()), f"rank {r}, {name}"


def _logged(path) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in map(json.loads, path.read_text().splitlines())}


def test_checkpoint_of_dp2_x_pp2_resumes_in_other_layouts_and_loads_into_one_process(tmp_path):
    root, log_a, log_b = tmp_path / "ckpt", tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    # AdamW: its sharded moments must be saved and resharded too
    argv = ["pipelining_transformer/train.py", *TINY, "--steps", "4", "--lr", "3e-3"]
    a = run_cli(*argv, "--world_size", "4", "--dp_size", "2", "--schedule", "Interleaved1F1B",
                "--checkpoint_dir", str(root), "--checkpoint_every", "2", "--loss_log", str(log_a),
                timeout=240)
    assert a.returncode == 0, a.stdout + a.stderr
    # rank 1 (replica 0, pp rank 1) holds the last stage, the looped 3, and reports
    assert "[rank 1] stages [1, 3] of 4 (Interleaved1F1B, manual split, replica 0 of 2)" in a.stdout
    assert "[rank 3] step" not in a.stdout, "only the first replica reports"
    whole = _logged(log_a)
    assert sorted(whole) == [1, 2, 3, 4], a.stdout

    saved = checkpoint.step_dir(root, 2)
    # saved once: the replicas' shards together are one copy of the weights and AdamW's two
    # moments (plus DCP's per-tensor headers, about 12% at this size), not dp_size copies
    args = make_args(*TINY)
    model = Transformer(model_args_from(args))
    one_copy = 3 * 4 * sum(p.numel() for p in model.parameters())
    written = sum(f.stat().st_size for f in saved.glob("*.distcp"))
    assert one_copy < written < 1.3 * one_copy, (written, one_copy)

    # the next steps in another layout (step 3's loss checks the weights, step 4's the
    # optimizer state too): 2 replicas of 1 rank (resharded: each now holds half of every
    # layer); plain tensors: the one process below
    for layout, log in ((("--world_size", "2", "--dp_size", "2"), log_b),):
        b = run_cli(*argv, *layout, "--resume", str(saved), "--loss_log", str(log), timeout=240)
        assert b.returncode == 0, b.stdout + b.stderr
        resumed = _logged(log)
        assert sorted(resumed) == [3, 4], b.stdout
        torch.testing.assert_close(torch.tensor([resumed[3], resumed[4]]),
                                   torch.tensor([whole[3], whole[4]]),
                                   msg=lambda m: f"{' '.join(layout)}: {m}")

    # one process, no process group: trains on the whole batch 3 (index 2) with the loaded
    # weights and AdamW state, and gets the losses of steps 3 and 4 the replicas logged
    args = make_args(*TINY, "--lr", "3e-3")
    opt = make_optimizer(args.optimizer, model.parameters(), args.lr)
    assert checkpoint.load(saved, [(model, opt)]) == 2
    losses = []
    for step in (2, 3):
        x, y = synthetic_batch(step, args.batch_size, args.seq_len, args.vocab_size, args.seed)
        opt.zero_grad()
        loss = tokenwise_loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    torch.testing.assert_close(torch.stack(losses), torch.tensor([whole[3], whole[4]]))


@pytest.mark.parametrize("argv, message", [
    (["--world_size", "3", "--dp_size", "2"], "--world_size 3 is not divisible by --dp_size 2"),
    (["--world_size", "4", "--dp_size", "2", "--batch_size", "12", "--n_microbatches", "4"],
     "--batch_size 12 is not divisible by --dp_size 2 x --n_microbatches 4"),
    (["--dp_size", "0"], "argument --dp_size: must be at least 1, got 0"),
    # the schedule is checked per replica: 1F1B on 2 ranks needs 2 micro-batches
    (["--world_size", "4", "--dp_size", "2", "--schedule", "1F1B", "--n_microbatches", "1"],
     "1F1B cannot run --n_microbatches 1 on 2 ranks per replica (--dp_size 2)"),
])
def test_bad_shapes_are_rejected_before_launch(argv, message, capsys, monkeypatch):
    err = refused_before_launch(main, argv, capsys, monkeypatch)
    assert message in err, err
