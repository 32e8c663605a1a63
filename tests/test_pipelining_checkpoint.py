"""pipelining_transformer checkpoints: a SIGKILLed run resumes exactly, dropout included (the
random state comes back in the layout that saved it); checkpoints load into any split and
into one process; incomplete, truncated or damaged checkpoints, and resumes
with other data settings, are refused."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import distkit
from conftest import REPO, checked_args, logged_losses, refused_before_launch, run_cli
from pipelining_transformer import checkpoint, extras
from pipelining_transformer.cli import data_settings_from
from pipelining_transformer.train import build_rank, init_distributed, main, model_args_from, train
from pipelining_transformer.model import Transformer, make_optimizer, synthetic_batch, tokenwise_loss_fn

# dropout 0 for the comparisons across splits: another layout draws other dropout masks
TINY = ("--dim", "16", "--n_heads", "2", "--vocab_size", "32", "--seq_len", "8", "--n_layers", "4",
        "--batch_size", "8", "--n_microbatches", "4", "--dropout", "0", "--seed", "3")
SAVED_AT = 2  # the cross-split test saves after this many steps


def make_args(*argv: str) -> argparse.Namespace:
    return checked_args("pipelining_transformer.train", *argv)


def test_sigkill_then_resume_equals_uninterrupted_run(tmp_path):
    steps, kill_after = 12, 3
    root, resumed_log, whole_log = tmp_path / "ckpt", tmp_path / "resumed.jsonl", tmp_path / "whole.jsonl"
    # the default dropout: only a restored random state gives the same masks after the resume
    argv = ["pipelining_transformer/train.py", *TINY, "--dropout", "0.1", "--steps", str(steps)]
    ckpt = ["--checkpoint_dir", str(root), "--checkpoint_every", "1", "--loss_log", str(resumed_log)]
    # its own session, so that one killpg takes the launcher and every worker at once
    proc = subprocess.Popen([sys.executable, *argv, *ckpt], cwd=REPO, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    marker = checkpoint.step_dir(root, kill_after) / checkpoint.COMPLETE
    deadline = time.monotonic() + 120
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGKILL)
    killed_output = proc.communicate()[0]
    assert marker.exists(), killed_output
    saved = checkpoint.latest_complete(root)
    resumed_at = int(saved.name.removeprefix("step_"))
    assert kill_after <= resumed_at < steps, f"the run was not killed mid-way: {killed_output}"
    # a step is logged before it is saved: the killed run may have logged steps after resumed_at
    killed = logged_losses(resumed_log)

    resumed = run_cli(*argv, *ckpt, "--resume", timeout=180)  # appends to the same log
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resumed from {saved} after step {resumed_at}" in resumed.stdout, resumed.stdout
    assert resumed.stdout.count("random state restored") == 2, resumed.stdout
    whole = run_cli(*argv, "--loss_log", str(whole_log), timeout=180)
    assert whole.returncode == 0, whole.stdout + whole.stderr

    expected = logged_losses(whole_log)
    assert [s for s, _ in expected] == list(range(1, steps + 1)), whole.stdout
    logged = logged_losses(resumed_log)
    assert logged[:len(killed)] == killed  # appended, not overwritten
    got = logged[len(killed):]
    assert [s for s, _ in got] == list(range(resumed_at + 1, steps + 1)), resumed.stdout
    for s, loss in got:  # the log is what the run printed, at full precision
        assert f"step {s}/{steps}  loss {loss:.4f}" in resumed.stdout, resumed.stdout
    # bit for bit: the resumed steps, and the killed run's before them
    assert got == expected[resumed_at:]
    assert killed == expected[:len(killed)]


def test_random_state_comes_back_only_into_the_layout_that_saved_it(tmp_path):
    args = make_args(*TINY)
    parts = [_one_step(args)]
    torch.manual_seed(11)
    saved_state = torch.get_rng_state()
    path = checkpoint.save(tmp_path, 1, parts, data_settings_from(args), layout="world_size=1 A")
    torch.manual_seed(12)
    untouched = torch.get_rng_state()
    checkpoint.load(path, parts)  # no layout: not a training resume, the state is left alone
    assert torch.equal(torch.get_rng_state(), untouched)
    checkpoint.load(path, parts, layout="world_size=1 A")
    assert torch.equal(torch.get_rng_state(), saved_state)
    # another layout: seeded from --seed, the step and the rank, the same on every resume
    checkpoint.load(path, parts, layout="world_size=2 A")
    other = torch.get_rng_state()
    assert not torch.equal(other, saved_state) and not torch.equal(other, untouched)
    torch.manual_seed(13)
    checkpoint.load(path, parts, layout="world_size=2 A")
    assert torch.equal(torch.get_rng_state(), other)


def _forward_backward(pp, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor] | None:
    """train.train's step on one of two stages (zero the grads, the schedule by role): its losses, or None."""
    for opt in pp.optimizers:
        opt.zero_grad(set_to_none=True)
    losses: list[torch.Tensor] = []
    pp.schedule.step(x) if pp.has_first else pp.schedule.step(target=y, losses=losses)
    return losses if pp.has_last else None


def _optimizer_step(pp) -> None:
    for opt in pp.optimizers:
        opt.step()


def _train_save_continue(rank: int, args: argparse.Namespace) -> list[float] | None:
    """Train SAVED_AT steps (2 stages), checkpoint, then take one step more and one forward.

    With args.load: build the stages from other weights, load the checkpoint instead.
    """
    env = init_distributed(rank, args)
    # the loading run starts from different weights: only the checkpoint can make them agree
    pp = build_rank(argparse.Namespace(**{**vars(args), "seed": args.seed + args.load}), env)
    parts = [(s.submod, opt) for s, opt in zip(pp.stages, pp.optimizers)]
    batch = lambda step: synthetic_batch(step, args.batch_size, args.seq_len, args.vocab_size,  # noqa: E731
                                         args.seed)
    if args.load:
        assert checkpoint.load(args.ckpt, parts) == SAVED_AT
    else:
        for step in range(SAVED_AT):
            _forward_backward(pp, *batch(step))
            _optimizer_step(pp)
        checkpoint.save(args.ckpt_root, SAVED_AT, parts, data_settings_from(args))
    losses = _forward_backward(pp, *batch(SAVED_AT))
    _optimizer_step(pp)  # uses the optimizer state the checkpoint carried
    after = _forward_backward(pp, *batch(SAVED_AT + 1))
    dist.destroy_process_group()
    if losses is None:
        return None
    return [torch.stack(mb).mean().item() for mb in (losses, after)]


def _last_rank_losses(results: dict) -> list[float]:
    losses = [r for r in results.values() if r is not None]
    assert len(losses) == 1
    return losses[0]


def test_checkpoint_loads_into_four_stages_and_into_one_process(tmp_path):
    args = make_args(*TINY, "--world_size", "2")
    args.ckpt_root, args.ckpt, args.load = tmp_path, checkpoint.step_dir(tmp_path, SAVED_AT), 0
    two_stages = _last_rank_losses(distkit.launch(_train_save_continue, args))
    assert checkpoint.problem(args.ckpt) is None

    # the same 2 ranks, Interleaved1F1B: 4 stages, cut by tracing
    four = make_args(*TINY, "--world_size", "2", "--schedule", "Interleaved1F1B", "--split", "tracer")
    four.ckpt_root, four.ckpt, four.load = tmp_path, args.ckpt, 1
    four_stages = _last_rank_losses(distkit.launch(_train_save_continue, four))
    # float32 losses as float32 tensors: as Python floats they would get float64's tolerance
    torch.testing.assert_close(torch.tensor(four_stages), torch.tensor(two_stages))

    # one process, the plain Transformer, no process group
    torch.manual_seed(args.seed + 7)
    model = Transformer(model_args_from(args))
    opt = make_optimizer(args.optimizer, model.parameters(), args.lr)
    assert checkpoint.load(args.ckpt, [(model, opt)]) == SAVED_AT
    one_process = []
    for step in (SAVED_AT, SAVED_AT + 1):
        x, y = synthetic_batch(step, args.batch_size, args.seq_len, args.vocab_size, args.seed)
        loss = tokenwise_loss_fn(model(x), y)
        one_process.append(loss.item())
        if step == SAVED_AT:
            opt.zero_grad()
            loss.backward()
            opt.step()
    torch.testing.assert_close(torch.tensor(one_process), torch.tensor(two_stages))


def _idle_around_a_save(rank: int, args: argparse.Namespace) -> dict:
    """train.py's run, with ``idle`` seconds of no progress (no forward, no optimizer step) before step 1's
    checkpoint, inside each save and after step 1's: 1.5 x --hang_timeout together, none over it alone."""
    idle = 0.5 * args.hang_timeout
    save = checkpoint.dcp.save

    def slow_save(state: dict, **kwargs):
        time.sleep(idle)
        return save(state, **kwargs)

    class Idle(extras.StepCallback):
        def on_step_end(self, step: int, loss: float | None) -> None:
            if step == 0:
                time.sleep(idle)

    checkpoint.dcp.save = slow_save  # this rank's process only
    env = init_distributed(rank, args)
    result = train(args, env, callbacks_for=lambda a, pp: [Idle(), *extras.callbacks_for(a, pp), Idle()])
    dist.destroy_process_group()
    return result


def test_a_checkpoint_save_counts_as_progress_for_the_hang_bound(tmp_path):
    # without distkit.progress() around the save, 1.5 x --hang_timeout without progress: a "hang" (exit 1)
    args = make_args(*TINY, "--world_size", "2", "--steps", "2", "--checkpoint_dir", str(tmp_path),
                     "--checkpoint_every", "1", "--hang_timeout", "5")
    results = distkit.launch(_idle_around_a_save, args)
    assert [len(results[rank]["losses"] or []) for rank in (0, 1)] == [0, 2]  # rank 1 reports
    assert checkpoint.latest_complete(tmp_path) == checkpoint.step_dir(tmp_path, 2)


def _one_step(args: argparse.Namespace) -> tuple[Transformer, torch.optim.Optimizer]:
    """The TINY model in this process after one AdamW step."""
    model = Transformer(model_args_from(args))
    opt = make_optimizer(args.optimizer, model.parameters(), args.lr)
    x, y = synthetic_batch(0, args.batch_size, args.seq_len, args.vocab_size, args.seed)
    tokenwise_loss_fn(model(x), y).backward()
    opt.step()
    return model, opt


@pytest.fixture
def saved(tmp_path):
    """A complete one-process checkpoint of the TINY model after one AdamW step."""
    args = make_args(*TINY)
    return checkpoint.save(tmp_path, 1, [_one_step(args)], data_settings_from(args))


@pytest.fixture
def refused(capsys, monkeypatch):
    """``refused(argv)``: main(TINY + argv) exits 2 with one line, before launching anything;
    returns that line."""
    return lambda argv: refused_before_launch(main, [*TINY, *argv], capsys, monkeypatch)


def test_a_load_restores_weights_optimizer_state_and_hyper_parameters(tmp_path):
    """PyTorch's set_state_dict puts back all the saved optimizer held, by parameter name,
    into an optimizer that has not stepped yet, made with another learning rate."""
    args = make_args(*TINY)
    model, opt = _one_step(args)
    path = checkpoint.save(tmp_path, 1, [(model, opt)], data_settings_from(args))
    other = Transformer(model_args_from(make_args(*TINY, "--seed", "9")))
    other_opt = make_optimizer(args.optimizer, other.parameters(), args.lr * 7)
    assert checkpoint.load(path, [(other, other_opt)]) == 1
    assert other_opt.param_groups[0]["lr"] == args.lr  # the checkpoint's, as load_state_dict does
    for (name, p), q in zip(model.named_parameters(), other.parameters()):
        assert torch.equal(p, q), name
        assert opt.state[p].keys() == other_opt.state[q].keys() == {"step", "exp_avg", "exp_avg_sq"}
        for key, value in opt.state[p].items():
            assert torch.equal(value, other_opt.state[q][key]), (name, key)


def test_truncated_or_unfinished_checkpoint_is_refused(saved, refused):
    assert checkpoint.problem(saved) is None
    data = sorted(saved.glob("*.distcp"))[0]
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 2)
    err = refused(["--resume", str(saved)])
    assert f"cannot resume from {saved}: {data.name} is truncated" in err, err

    (saved / checkpoint.COMPLETE).unlink()  # as if the run died before every rank finished
    err = refused(["--resume", str(saved)])
    assert "no COMPLETE marker: its save never finished" in err, err


@pytest.mark.parametrize("marker, message", [
    ({"step": 5}, "its COMPLETE marker is damaged (no step or no file sizes)"),
    ([], "its COMPLETE marker is damaged (no step or no file sizes)"),
    ({"step": 5, "files": {".metadata": "big"}}, "its COMPLETE marker is damaged"),
    ({"step": 5, "files": {}}, "its COMPLETE marker does not list .metadata"),
    (None, "its .metadata cannot be read"),  # the marker is right; .metadata is not
])
def test_damaged_marker_or_metadata_is_refused_and_skipped(saved, refused, marker, message):
    # a newer checkpoint, the same files, damaged: valid JSON but not a marker save() wrote,
    # or a .metadata of the right size that is not a pickle
    damaged = shutil.copytree(saved, checkpoint.step_dir(saved.parent, 5))
    if marker is None:
        meta = damaged / ".metadata"
        meta.write_bytes(b"\x80" * meta.stat().st_size)
    else:
        (damaged / checkpoint.COMPLETE).write_text(json.dumps(marker))
    assert message in checkpoint.problem(damaged)
    assert checkpoint.latest_complete(saved.parent) == saved  # skipped, with a warning
    err = refused(["--resume", str(damaged)])
    assert f"cannot resume from {damaged}: {message}" in err, err
    if marker is None:  # asked directly, incompatibility() says so too instead of raising
        args = make_args(*TINY)
        assert message in checkpoint.incompatibility(damaged, model_args_from(args), args.optimizer,
                                                     data_settings_from(args))


def test_resume_picks_the_newest_complete_checkpoint(saved, refused):
    root = saved.parent
    (root / "step_5").mkdir()  # a newer save cut short: no marker
    (root / "step_5" / ".metadata").write_bytes(b"\0")
    assert checkpoint.latest_complete(root) == saved
    assert make_args(*TINY, "--checkpoint_dir", str(root), "--resume").resume_path == str(saved)
    err = refused(["--resume", str(saved), "--dim", "32"])
    assert "its tok_embeddings.weight is (32, 16), this model's is (32, 32)" in err, err
    err = refused(["--resume", str(saved), "--optimizer", "sgd"])
    assert "is not --optimizer sgd's" in err, err
    assert "needs --checkpoint_dir" in refused(["--resume"])


def test_resume_with_other_data_settings_is_refused(saved, refused, tmp_path):
    # TINY is --seed 3 --batch_size 8 --seq_len 8 --vocab_size 32
    err = refused(["--resume", str(saved), "--seed", "4", "--batch_size", "16"])
    assert (f"cannot resume from {saved}: it was saved with --seed 3 --batch_size 8, "
            f"not --seed 4 --batch_size 16 (another data stream)") in err, err
    # named as a data flag, although the embedding's shape differs too
    err = refused(["--checkpoint_dir", str(saved.parent), "--resume", "--vocab_size", "64"])
    assert "it was saved with --vocab_size 32, not --vocab_size 64" in err, err
    err = refused(["--resume", str(saved), "--seq_len", "4"])
    assert "it was saved with --seq_len 8, not --seq_len 4" in err, err
    # what only cuts the same batches differently does not change the stream
    assert make_args(*TINY, "--resume", str(saved), "--n_microbatches", "2",
                     "--world_size", "4", "--n_layers", "4").resume_path == str(saved)

    # a checkpoint that does not say which stream it was on is not trusted to continue one
    unknown = checkpoint.save(tmp_path / "unknown", 1, [_one_step(make_args(*TINY))], {})
    err = refused(["--resume", str(unknown)])
    assert ("it does not record its data settings (--seed, --batch_size, --seq_len, "
            "--vocab_size)") in err, err


def test_bad_checkpoint_from_the_command_line_is_one_line_exit_2(tmp_path):
    proc = run_cli("pipelining_transformer/train.py", *TINY, "--resume", str(tmp_path / "step_9"),
                   timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert f"argument --resume: {tmp_path / 'step_9'}: no such directory" in proc.stderr, proc.stderr
