"""pipelining_transformer checkpoints: a SIGKILLed run resumes exactly; checkpoints load into
any split and into one process; incomplete or truncated checkpoints are refused."""
from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import distkit
from conftest import REPO, run_cli
from pipelining_transformer import checkpoint
from pipelining_transformer.main import build_parser, build_rank, check_args, main, model_args_from
from pipelining_transformer.model import Transformer, tokenwise_loss_fn
from pipelining_transformer.parallel import init_distributed, make_optimizer, synthetic_batch

# dropout 0: dropout masks come from each process's RNG, which a checkpoint does not hold
TINY = ("--dim", "16", "--n_heads", "2", "--vocab_size", "32", "--seq_len", "8", "--n_layers", "4",
        "--batch_size", "8", "--n_microbatches", "4", "--dropout", "0", "--seed", "3")
SAVED_AT = 2  # the cross-split test saves after this many steps


def make_args(*argv: str) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(list(argv))
    check_args(parser, args)
    return args


def cli_losses(stdout: str) -> dict[int, float]:
    return {int(s): float(x) for s, x in re.findall(r"step (\d+)/\d+  loss (\S+)", stdout)}


def test_sigkill_then_resume_equals_uninterrupted_run(tmp_path):
    steps, kill_after = 12, 3
    argv = ["pipelining_transformer/main.py", *TINY, "--steps", str(steps)]
    ckpt = ["--checkpoint_dir", str(tmp_path), "--checkpoint_every", "1"]
    # its own session, so that one killpg takes the launcher and every worker at once
    proc = subprocess.Popen([sys.executable, *argv, *ckpt], cwd=REPO, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    marker = checkpoint.step_dir(tmp_path, kill_after) / checkpoint.COMPLETE
    deadline = time.monotonic() + 120
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGKILL)
    killed_output = proc.communicate()[0]
    assert marker.exists(), killed_output
    saved = checkpoint.latest_complete(tmp_path)
    resumed_at = int(saved.name.removeprefix("step_"))
    assert kill_after <= resumed_at < steps, f"the run was not killed mid-way: {killed_output}"

    resumed = run_cli(*argv, *ckpt, "--resume", timeout=180)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resumed from {saved} after step {resumed_at}" in resumed.stdout, resumed.stdout
    whole = run_cli(*argv, timeout=180)
    assert whole.returncode == 0, whole.stdout + whole.stderr

    expected, got = cli_losses(whole.stdout), cli_losses(resumed.stdout)
    assert sorted(expected) == list(range(1, steps + 1)), whole.stdout
    assert sorted(got) == list(range(resumed_at + 1, steps + 1)), resumed.stdout
    torch.testing.assert_close([got[s] for s in sorted(got)],
                               [expected[s] for s in sorted(got)], rtol=0, atol=1e-4)


def _train_save_continue(worker: distkit.Worker, args: argparse.Namespace) -> list[float] | None:
    """Train SAVED_AT steps (2 stages), checkpoint, then take one step more and one forward.

    With args.load: build the stages from other weights, load the checkpoint instead.
    """
    env = init_distributed(args.device)
    # the loading run starts from different weights: only the checkpoint can make them agree
    pp = build_rank(argparse.Namespace(**{**vars(args), "seed": args.seed + args.load}), env)
    parts = [(s.submod, opt) for s, opt in zip(pp.stages, pp.optimizers)]
    batch = lambda step: synthetic_batch(step, args.batch_size, args.seq_len, args.vocab_size,  # noqa: E731
                                         args.seed)
    if args.load:
        assert checkpoint.load(args.ckpt, parts) == SAVED_AT
    else:
        for step in range(SAVED_AT):
            pp.forward_backward(*batch(step))
            pp.optimizer_step()
        checkpoint.save(args.ckpt_root, SAVED_AT, parts)
    losses = pp.forward_backward(*batch(SAVED_AT))
    pp.optimizer_step()  # uses the optimizer state the checkpoint carried
    after = pp.forward_backward(*batch(SAVED_AT + 1))
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
    torch.testing.assert_close(four_stages, two_stages)

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
    torch.testing.assert_close(one_process, two_stages)


@pytest.fixture
def saved(tmp_path):
    """A complete one-process checkpoint of the TINY model after one AdamW step."""
    args = make_args(*TINY)
    model = Transformer(model_args_from(args))
    opt = make_optimizer(args.optimizer, model.parameters(), args.lr)
    x, y = synthetic_batch(0, args.batch_size, args.seq_len, args.vocab_size, args.seed)
    tokenwise_loss_fn(model(x), y).backward()
    opt.step()
    return checkpoint.save(tmp_path, 1, [(model, opt)])


def _refused(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([*TINY, *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


def test_truncated_or_unfinished_checkpoint_is_refused(saved, capsys):
    assert checkpoint.problem(saved) is None
    data = sorted(saved.glob("*.distcp"))[0]
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 2)
    err = _refused(["--resume", str(saved)], capsys)
    assert f"cannot resume from {saved}: {data.name} is truncated" in err, err

    (saved / checkpoint.COMPLETE).unlink()  # as if the run died before every rank finished
    err = _refused(["--resume", str(saved)], capsys)
    assert "no COMPLETE marker: its save never finished" in err, err


def test_resume_picks_the_newest_complete_checkpoint(saved, capsys):
    root = saved.parent
    (root / "step_5").mkdir()  # a newer save cut short: no marker
    (root / "step_5" / ".metadata").write_bytes(b"\0")
    assert checkpoint.latest_complete(root) == saved
    assert make_args(*TINY, "--checkpoint_dir", str(root), "--resume").resume_path == str(saved)
    err = _refused(["--resume", str(saved), "--dim", "32"], capsys)
    assert "its tok_embeddings.weight is (32, 16), this model's is (32, 32)" in err, err
    err = _refused(["--resume", str(saved), "--optimizer", "sgd"], capsys)
    assert "is not --optimizer sgd's" in err, err
    assert "needs --checkpoint_dir" in _refused(["--resume"], capsys)


def test_bad_checkpoint_from_the_command_line_is_one_line_exit_2(tmp_path):
    proc = run_cli("pipelining_transformer/main.py", *TINY, "--resume", str(tmp_path / "step_9"),
                   timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert "cannot resume from" in proc.stderr and "no such directory" in proc.stderr
