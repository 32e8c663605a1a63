"""pipelining_transformer under torchrun's elastic restarts (``--max-restarts``).

A worker SIGKILLed mid-run is restarted by torchrun with the whole group; every rank
resumes from the same newest complete checkpoint and the run logs exactly the losses of an
uninterrupted one (default dropout: the random state is in the checkpoint). A kill inside
a checkpoint write leaves a checkpoint that the restart skips. A kill after the restarts
are used up ends the job with torchrun's report; a SIGKILLed torchrun takes its workers along.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import (Job, REPO, assert_all_gone, assert_equals_uninterrupted, logged_losses,
                      resumed_steps, run_cli, workers_by_rank)
from pipelining_transformer import checkpoint

# the default --dropout 0.1: masks are drawn every step, so only a restored random state
# makes a resumed run equal an uninterrupted one
TINY = ("--dim", "32", "--n_layers", "2", "--n_heads", "2", "--vocab_size", "64", "--seed", "5")
STEPS = 16
TORCHRUN = ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            "--max-restarts", "1")


def torchrun_job(tmp_path: Path, script: str = "pipelining_transformer/train.py",
                 steps: int = STEPS) -> Job:
    """The README's command: checkpoints every 2 steps, resumes from the newest complete one."""
    return Job((*TORCHRUN, script, *TINY, "--steps", str(steps), "--checkpoint_dir",
                str(tmp_path / "ckpt"), "--checkpoint_every", "2", "--resume",
                "--loss_log", str(tmp_path / "losses.jsonl")))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, float]:
    """Step -> loss of one uninterrupted run (spawned, 2 ranks: the layout torchrun's has)."""
    log = tmp_path_factory.mktemp("uninterrupted") / "losses.jsonl"
    proc = run_cli("pipelining_transformer/train.py", "--world_size", "2", *TINY,
                   "--steps", str(STEPS), "--loss_log", str(log), timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    losses = dict(logged_losses(log))
    assert list(losses) == list(range(1, STEPS + 1))
    return losses


def wait_until(condition, job: Job, what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if job.proc.poll() is not None:
            pytest.fail(f"torchrun exited {job.proc.returncode} before {what}:\n{job.text()}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {timeout} s:\n{job.text()}")
        time.sleep(0.01)


def finish(job: Job, timeout: float) -> int:
    """torchrun's exit status; a failure with its output, not a bare timeout, if it hangs."""
    try:
        return job.finish(timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"torchrun still running after {timeout} s:\n{job.text()}")


@pytest.mark.timeout(300)
def test_sigkilled_worker_is_restarted_and_the_run_equals_an_uninterrupted_one(tmp_path,
                                                                              uninterrupted):
    job = torchrun_job(tmp_path)
    try:
        marker = checkpoint.step_dir(tmp_path / "ckpt", 4) / checkpoint.COMPLETE
        wait_until(marker.exists, job, "the step 4 checkpoint")
        first = workers_by_rank(job.proc.pid)
        # rank 0: the rank that writes the markers; the group it left behind restarts in the
        # agent's store, under keys of the restart's own (train.py's init_distributed)
        os.kill(first[0], signal.SIGKILL)
        assert finish(job, timeout=180) == 0, job.text()
    finally:
        job.kill()
    text = job.text()
    # torchrun names the failure it saw first: rank 0's SIGKILL, or rank 1's error at the loss of its peer
    # when one poll of a loaded machine found both gone
    assert (f"local_rank: 0 (pid: {first[0]})" in text and "exitcode: -9" in text) or "local_rank: 1" in text, text
    resumed = resumed_steps(job.text())
    assert len(resumed) == 2 and len(set(resumed)) == 1, text  # both ranks, the same one
    assert 4 <= resumed[0] < STEPS, text
    assert text.count("random state restored") == 2, text
    assert_equals_uninterrupted(tmp_path / "losses.jsonl", uninterrupted, resumed[0])


@pytest.mark.timeout(300)
def test_kill_inside_a_checkpoint_write_leaves_nothing_a_restart_loads(tmp_path, uninterrupted,
                                                                      monkeypatch):
    # Job's processes inherit this: rank 0 dies between dcp.save of step 6 and the marker
    monkeypatch.setenv("KILL_STEP", "6")
    job = torchrun_job(tmp_path, script=str(REPO / "tests" / "kill_in_save.py"))
    try:
        assert finish(job, timeout=180) == 0, job.text()
    finally:
        job.kill()
    text = job.text()
    assert "kill_in_save: rank 0 dies after dcp.save of step 6" in text, text
    # the restart saw step_6 (all of DCP's files) without its marker, and went back to step 4
    assert re.search(r"skipping \S+/step_6: no COMPLETE marker", text), text
    assert resumed_steps(job.text()) == [4, 4], text
    assert_equals_uninterrupted(tmp_path / "losses.jsonl", uninterrupted, 4)
    assert checkpoint.problem(checkpoint.step_dir(tmp_path / "ckpt", 6)) is None  # saved again


@pytest.mark.timeout(300)
def test_a_kill_after_the_restarts_are_used_up_fails_the_job(tmp_path):
    job = torchrun_job(tmp_path, steps=100_000)
    try:
        marker = checkpoint.step_dir(tmp_path / "ckpt", 2) / checkpoint.COMPLETE
        wait_until(marker.exists, job, "the step 2 checkpoint")
        os.kill(workers_by_rank(job.proc.pid)[1], signal.SIGKILL)
        wait_until(lambda: len(resumed_steps(job.text())) == 2, job, "the restarted group")
        second = workers_by_rank(job.proc.pid)
        os.kill(second[1], signal.SIGKILL)  # --max-restarts 1: this one is not survived
        status = finish(job, timeout=120)
    finally:
        job.kill()
    text = job.text()
    assert status != 0, text
    # torchrun's report names the root cause: the worker killed the second time
    report = text[text.index("Root Cause (first observed failure)"):]
    assert f"exitcode  : -9 (pid: {second[1]})" in report, text
    assert_all_gone(list(second.values()), within=10)


@pytest.mark.timeout(300)
def test_sigkilled_torchrun_takes_its_workers_along(tmp_path):
    job = Job((*TORCHRUN, "pipelining_transformer/train.py", *TINY, "--steps", "100000"))
    workers: list[int] = []
    try:
        job.wait_for(r"step 1/")
        workers = list(workers_by_rank(job.proc.pid).values())
        assert len(workers) == 2, job.text()
        job.proc.kill()  # torchrun alone; its workers are in sessions of their own
        assert_all_gone(workers, within=10)
    finally:
        job.kill()
        for pid in workers:  # were the test to fail, leave nothing training behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
