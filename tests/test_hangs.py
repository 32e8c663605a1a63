"""No silent hang: a job that stops making progress ends within --hang_timeout plus a few seconds,
with a line saying so and the stack of every rank that can print one, and leaves no process behind.

The bound is distkit/rank.py's ``HangBound``, one per rank: its progress is PyTorch's global
module-forward and optimizer-step hooks, ``distkit.progress()`` (a checkpoint's save) and the answers
to a waiting role's pings (``distkit.wait_on``), so the examples' training code carries nothing for it.
tests/hang_worker.py makes the hangs.
"""
from __future__ import annotations

import argparse
import importlib
import os
import re
import signal
import time

import pytest
from torch.multiprocessing.spawn import ProcessExitedException

import distkit
import hang_worker
from conftest import EXAMPLES, REPO, Job, assert_all_gone, checked_args, workers_by_rank
from distkit.rank import MARGIN, PEER_GRACE

HANG_TIMEOUT = 3
# after the bound: the rank that saw the hang waits PEER_GRACE s for its peers' stacks, mp.spawn then ends
# the others; a loaded 2-core machine adds a few seconds of noise
SLACK = PEER_GRACE + 15
SPAWN_GRACE = 30  # mp.spawn gives the other ranks 30 s to take its SIGTERM, which a stopped one cannot
TORCHRUN_GRACE = 30  # torchrun's agent likewise
NO_PROGRESS = r"\[rank {rank}\] no progress \(.*\) for \d+ s, over --hang_timeout {timeout:g}: a hang"


def hang_args(mode: str, *argv: str) -> argparse.Namespace:
    parser = hang_worker.build_parser()
    args = parser.parse_args([mode, "--threads", "1", *argv])
    distkit.check_launch_args(parser, args)
    return args


def stacks_of(text: str, rank: int) -> str:
    """Rank ``rank``'s report: its line, then its threads' stacks (faulthandler's), up to the next rank's."""
    start = re.search(NO_PROGRESS.format(rank=rank, timeout=HANG_TIMEOUT), text)
    assert start, text
    rest = text[start.end():]
    end = re.search(r"\[rank \d+\] no progress|Timeout \(|Traceback", rest)
    return rest[:end.start() if end else None]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("launcher", ["spawn", "torchrun"])
def test_a_deadlock_ends_with_where_every_rank_waits(launcher):
    """No process is stopped: each rank waits on a recv that nobody sends (in C, the GIL released)."""
    argv = ("tests/hang_worker.py", "deadlock", "--hang_timeout", str(HANG_TIMEOUT))
    job = Job(argv if launcher == "spawn" else
              ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *argv))
    try:
        job.wait_for(r"rank 0 waits")
        job.wait_for(r"rank 1 waits")
        start = time.monotonic()
        assert job.finish(timeout=HANG_TIMEOUT + SLACK + 60) == 1, job.text()
        took = time.monotonic() - start
        text = job.text()
        assert took < HANG_TIMEOUT + SLACK, f"ended {took:.0f} s after the ranks blocked:\n{text}"
        for rank in (0, 1):
            assert re.search(r"line \d+ in recv", stacks_of(text, rank)), text  # where it waits
        if launcher == "spawn":
            assert re.search(r"ProcessExitedException: process [01] terminated with exit code 1", text), text
        else:  # the rank's error file: the line is torchrun's root cause
            summary = text[text.index("Root Cause (first observed failure)"):]
            assert "TimeoutError: no progress" in summary and "error_file: <N/A>" not in summary, text
    finally:
        job.kill()


@pytest.mark.timeout(120)
def test_a_rank_stuck_in_python_ends_with_its_stack(capfd):
    """Rank 1 loops in Python, never a forward: its bound's thread still runs (the GIL is shared)."""
    start = time.monotonic()
    with pytest.raises(ProcessExitedException):
        distkit.launch(hang_worker.run_worker, hang_args("python", "--hang_timeout", str(HANG_TIMEOUT)))
    err = capfd.readouterr().err
    assert time.monotonic() - start < HANG_TIMEOUT + SLACK + 10, err  # + the ranks' start
    assert "in spin_in_python" in stacks_of(err, 1), err
    assert re.search(r"line \d+ in recv", stacks_of(err, 0)), err


@pytest.mark.timeout(120)
def test_a_rank_that_holds_the_gil_ends_with_its_stack(capfd):
    """Rank 1 is in one C call that holds the GIL: no Python thread of its runs, and faulthandler's C timer,
    which its bound keeps armed, prints its stack and ends it MARGIN s after the bound; rank 0, blocked on it,
    prints its own line and stacks and waits PEER_GRACE s for that (with the timer armed only by the bound's
    thread, a rank frozen right after its first progress kept the start-up's 120 s bound: no stack)."""
    start = time.monotonic()
    with pytest.raises(ProcessExitedException):
        distkit.launch(hang_worker.run_worker, hang_args("gil", "--hang_timeout", str(HANG_TIMEOUT)))
    err = capfd.readouterr().err  # faulthandler writes to the rank's file descriptor 2
    assert time.monotonic() - start < HANG_TIMEOUT + MARGIN + SLACK + 10, err
    assert re.search(r"line \d+ in recv", stacks_of(err, 0)), err
    frozen = err[err.index("Timeout ("):]
    assert re.search(r"line \d+ in match\n.*line \d+ in run_worker", frozen), err


@pytest.mark.timeout(120)
def test_a_slow_but_progressing_run_is_not_stopped():
    """One forward a second for 8 s, with a 2.5 s bound: progress, not total time, is bounded."""
    start = time.monotonic()
    distkit.launch(hang_worker.run_worker, hang_args("slow", "--seconds", "8", "--hang_timeout", "2.5"))
    assert time.monotonic() - start >= 8  # past its bound three times over, and it ended normally


@pytest.mark.timeout(120)
def test_a_checkpoint_save_counts_as_progress():
    """Forwards 3.6 s apart under a 2 s bound, a save between each two with ``distkit.progress()`` on
    both sides of it, as pipelining_transformer/train.py's checkpoints: no hang (without the calls, one)."""
    distkit.launch(hang_worker.run_worker, hang_args("checkpoint", "--seconds", "8", "--hang_timeout", "2"))


@pytest.mark.timeout(120)
def test_a_waiting_rank_is_kept_alive_by_its_pings():
    """Rank 1 only waits on rank 0 (an observer, a parameter server), 8 s under a 2 s bound: the answers
    to its pings (``distkit.wait_on``) are its progress."""
    start = time.monotonic()
    distkit.launch(hang_worker.run_worker, hang_args("waits", "--seconds", "8", "--hang_timeout", "2"))
    assert time.monotonic() - start >= 8  # past its bound four times over, and it ended normally


@pytest.mark.timeout(300)
def test_ddp_rpc_runs_to_the_end_at_a_short_hang_timeout():
    """ddp_rpc's master and parameter server only wait while the trainers train: their pings keep them."""
    args = checked_args("ddp_rpc.main", "--epochs", "3", "--batches_per_epoch", "6", "--batch_size", "4",
                        "--hang_timeout", "5")
    distkit.launch(importlib.import_module("ddp_rpc.main").run_worker, args)


def check_report(text: str, stopped: int, ranks: list[int]) -> None:
    """Every rank but the stopped one says it made no progress and prints its stacks; a stopped process
    prints nothing."""
    for rank in ranks:
        found = re.search(NO_PROGRESS.format(rank=rank, timeout=HANG_TIMEOUT), text)
        if rank == stopped:
            assert not found, text
        else:
            assert found and "(most recent call first)" in stacks_of(text, rank), text


# the rank whose stop ends the job: one RPC job's driver (rpc_rl's agent: its observers' pings go
# unanswered) and one rank of a process-group job (the pipeline's first stage)
STOPPED = [("rpc_rl", 0), ("pipelining_transformer", 0)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name, rank", STOPPED, ids=[f"{n}-rank{r}" for n, r in STOPPED])
def test_a_stopped_rank_ends_the_job_with_the_others_stacks(name, rank):
    """A rank SIGSTOPped mid-training: the others reach their bound; mp.spawn then ends the stopped one,
    which cannot take its SIGTERM, with SIGKILL after its 30 s."""
    job = Job((*EXAMPLES[name].argv, "--hang_timeout", str(HANG_TIMEOUT)))
    try:
        job.wait_for(EXAMPLES[name].ready)
        workers = job.workers()
        start = time.monotonic()
        os.kill(workers[rank], signal.SIGSTOP)
        assert job.finish(timeout=HANG_TIMEOUT + SLACK + SPAWN_GRACE + 60) == 1, job.text()
        took = time.monotonic() - start
        assert took < HANG_TIMEOUT + SLACK + SPAWN_GRACE, f"ended after {took:.0f} s:\n{job.text()}"
        check_report(job.text(), rank, list(range(len(workers))))
        assert_all_gone(job.processes(), within=10)
    finally:
        job.kill()


@pytest.mark.timeout(300)
def test_a_stopped_rank_under_torchrun_ends_the_job():
    ex = EXAMPLES["pipelining_transformer"]
    flags = list(ex.argv)
    del flags[flags.index("--world_size"):flags.index("--world_size") + 2]  # torchrun's
    job = Job(("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *flags,
               "--hang_timeout", str(HANG_TIMEOUT)))
    try:
        job.wait_for(ex.ready)
        workers = workers_by_rank(job.proc.pid)
        assert sorted(workers) == [0, 1], job.text()
        start = time.monotonic()
        os.kill(workers[1], signal.SIGSTOP)
        assert job.finish(timeout=HANG_TIMEOUT + SLACK + TORCHRUN_GRACE + 60) != 0, job.text()
        # rank 0 reaches its bound and exits; torchrun's agent then ends the stopped rank 1 (SIGTERM, which
        # a stopped process cannot take, then SIGKILL after 30 s)
        assert time.monotonic() - start < HANG_TIMEOUT + SLACK + TORCHRUN_GRACE, job.text()
        check_report(job.text(), 1, [0, 1])
        assert_all_gone(list(workers.values()), within=10)
    finally:
        job.kill()


@pytest.mark.timeout(300)
def test_a_job_paused_longer_than_its_bound_ends_when_resumed():
    """Ctrl+Z stops every process of the job (SIGTSTP; SIGSTOP here), ``fg`` resumes them (SIGCONT): the
    pause counted toward --hang_timeout, so each rank reports a hang as it resumes (docs/failures.md)."""
    job = Job(("tests/hang_worker.py", "slow", "--seconds", "600", "--hang_timeout", str(HANG_TIMEOUT)))
    try:
        job.wait_for(r"rank 0 made progress")
        job.wait_for(r"rank 1 made progress")
        os.killpg(job.proc.pid, signal.SIGSTOP)
        time.sleep(HANG_TIMEOUT + 2)
        os.killpg(job.proc.pid, signal.SIGCONT)
        assert job.finish(timeout=SLACK + 30) == 1, job.text()
        assert re.search(NO_PROGRESS.format(rank=r"[01]", timeout=HANG_TIMEOUT), job.text()), job.text()
        assert_all_gone(job.processes(), within=10)
    finally:
        job.kill()


def hang_timeout_of(argv: list[str]) -> float:
    """--hang_timeout of the command ``python argv`` as its example's check_args leaves it."""
    module = importlib.import_module(argv[0].removesuffix(".py").replace("/", "."))
    parser = module.build_parser()
    stated = re.search(r"^ +--hang_timeout S (.*?)(?=^ +-)", parser.format_help(), re.M | re.S)
    assert stated and "(default: " in stated.group(1), parser.format_help()  # --help says it
    args = parser.parse_args(argv[1:])
    module.check_args(parser, args)  # rpc_pipeline_resnet/main.py's depends on the batch
    return args.hang_timeout


def test_every_quick_start_command_ends_a_stall_within_a_minute():
    """A stalled quick start ends on its own, with every rank's stack, within about a minute;
    each default chosen from the longest time without progress in the largest command its README
    documents, measured on a loaded 2-core machine (docs/failures.md)."""
    script = (REPO / "scripts" / "run_examples.sh").read_text()
    commands = [line.split("#")[0].split()[2:] for line in script.splitlines() if line.startswith('run "$PY" ')]
    assert len(commands) == 6, commands
    for argv in commands:
        assert 0 < hang_timeout_of(argv) <= 60, argv
    # the tutorial's 120 images: one backward of 30 s without a forward on that machine
    assert hang_timeout_of(["rpc_pipeline_resnet/main.py", "--batch_size", "120", "--num_batches", "3"]) == 300
    assert hang_timeout_of(["rpc_pipeline_resnet/main.py", "--hang_timeout", "20", "--batch_size", "120"]) == 20
