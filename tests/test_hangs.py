"""No silent hang (issue 21): a job that stops making progress ends within --hang_timeout plus
a margin, naming the rank that stopped (or saying that all of them wait on each other), with
the Python stack of every rank that can still answer, and leaves no process behind.

The watchdog is distkit/watchdog.py; its progress is PyTorch's global module-forward and
optimizer-step hooks, so the examples' code carries nothing for it.
"""
from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from conftest import run_cli
from test_faults import EXAMPLES, Job, _children, _cmdline, assert_all_gone, module_of

HANG_TIMEOUT = 5
# the claiming rank waits up to 5 s for the others' stacks (watchdog.ANSWER_WAIT), the
# launcher up to 5 s for a stopped process to take SIGTERM before SIGKILL; a loaded 2-core
# machine adds start-up noise
MARGIN = 25

# the rank whose stop ends the job: the one that drives the others, and each pipeline rank
STOPPED = [("rpc_rl", 0), ("ddp_rpc", 2), ("rpc_rnn", 1), ("rpc_pipeline_resnet", 0),
           ("rpc_pipeline_resnet.pipelining", 1), ("pipelining_transformer", 0),
           ("pipelining_transformer", 1)]


def check_report(text: str, stopped: int, ranks: list[int]) -> None:
    """The report names the stopped rank, and every other rank printed its stacks."""
    assert re.search(rf"rank {stopped} (did not answer|stopped answering)", text), text
    for rank in ranks:
        if rank != stopped:
            assert f"[rank {rank}] stacks (every thread)" in text, text
    assert f"[rank {stopped}] stacks" not in text, text  # a stopped process prints nothing


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name, rank", STOPPED, ids=[f"{n}-rank{r}" for n, r in STOPPED])
def test_a_stopped_rank_ends_the_job_with_the_others_stacks(name, rank):
    """The driving rank SIGSTOPped mid-training (for the pipeline, each rank in turn)."""
    job = Job((*EXAMPLES[name].argv, "--hang_timeout", str(HANG_TIMEOUT)))
    try:
        job.wait_for(EXAMPLES[name].ready)
        workers = job.workers()
        start = time.monotonic()
        os.kill(workers[rank], signal.SIGSTOP)
        assert job.finish(timeout=HANG_TIMEOUT + MARGIN + 30) == 1, job.text()
        took = time.monotonic() - start
        assert took < HANG_TIMEOUT + MARGIN, f"ended after {took:.0f} s:\n{job.text()}"
        check_report(job.text(), rank, list(range(len(workers))))
        assert_all_gone(workers, within=10)
    finally:
        job.kill()


def torchrun_workers(launcher: int, script: str) -> dict[int, int]:
    """{rank: pid} of the workers a torchrun process started."""
    found = {}
    for pid in _children(launcher):
        if script.encode() in _cmdline(pid) and b"torch.distributed.run" not in _cmdline(pid):
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            rank = next(int(v.split(b"=")[1]) for v in env if v.startswith(b"RANK="))
            found[rank] = pid
    return found


@pytest.mark.timeout(300)
def test_a_stopped_rank_under_torchrun_ends_the_job():
    script = "pipelining_transformer/main.py"
    ex = EXAMPLES["pipelining_transformer"]
    flags = list(ex.argv)
    del flags[flags.index("--world_size"):flags.index("--world_size") + 2]  # torchrun's
    job = Job(("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *flags,
               "--hang_timeout", str(HANG_TIMEOUT)))
    try:
        job.wait_for(ex.ready)
        workers = torchrun_workers(job.proc.pid, script)
        assert sorted(workers) == [0, 1], job.text()
        start = time.monotonic()
        os.kill(workers[1], signal.SIGSTOP)
        assert job.finish(timeout=HANG_TIMEOUT + MARGIN + 30) != 0, job.text()
        assert time.monotonic() - start < HANG_TIMEOUT + MARGIN, job.text()
        check_report(job.text(), 1, [0, 1])
        assert_all_gone(list(workers.values()), within=10)
    finally:
        job.kill()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("launcher", ["spawn", "torchrun"])
def test_a_deadlock_is_reported_with_where_every_rank_waits(launcher):
    """No process is stopped: each rank waits on a recv that nobody sends."""
    argv = ("tests/hang_worker.py", "deadlock", "--hang_timeout", "3")
    start = time.monotonic()
    if launcher == "spawn":
        proc = run_cli(*argv, timeout=120)
    else:
        proc = run_cli("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *argv,
                       timeout=120)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text
    assert time.monotonic() - start < 3 + MARGIN + 15, text  # + two interpreters' start-up
    assert "every rank answered: they wait on each other (a deadlock)" in text, text
    for rank in (0, 1):
        stacks = text.split(f"[rank {rank}] stacks (every thread)")[1]
        assert re.search(r"line \d+ in recv", stacks.split("[rank")[0]), text  # where it waits


@pytest.mark.timeout(300)
def test_a_slow_but_progressing_run_is_not_stopped():
    """One forward a second for 8 s, with a 2.5 s bound: progress, not total time, is bounded."""
    proc = run_cli("tests/hang_worker.py", "slow", "--seconds", "8", "--hang_timeout", "2.5",
                   timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "stacks" not in proc.stderr, proc.stderr


def test_every_example_has_a_hang_timeout_it_states():
    import importlib

    for name in EXAMPLES:
        parser = importlib.import_module(module_of(name)).build_parser()
        assert 0 < parser.parse_args([]).hang_timeout <= 600
        assert "--hang_timeout" in parser.format_help() and "(default:" in parser.format_help()
