"""No silent hang: a job that stops making progress ends within --hang_timeout plus
a margin, naming the rank that stopped (or saying that all of them wait on each other), with
the Python stack of every rank that can still answer, and leaves no process behind.

The watchdog is distkit/watchdog.py; its progress is PyTorch's global module-forward and
optimizer-step hooks, so the examples' code carries nothing for it.
"""
from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest

from conftest import EXAMPLES, REPO, Job, assert_all_gone, children, cmdline, run_cli
from distkit import watchdog

HANG_TIMEOUT = 5
# a rank that saw the hang waits up to 5 s for its live peers' stacks (watchdog.PEER_WAIT), the
# launcher up to 2 s for a stopped process to take SIGTERM before SIGKILL; a loaded 2-core
# machine adds start-up noise
MARGIN = 25
TORCHRUN_GRACE = 30  # torchrun's agent gives a failed job's other workers 30 s to take SIGTERM

# the rank whose stop ends the job: one RPC job's driver (rpc_rl's agent) and one rank of a
# process-group job (the pipeline's first stage; under torchrun, the test below stops rank 1).
# The watchdog is the same code in every example: the other examples' cases took two
# minutes of the suite and guarded nothing more (with the claim's silent ranks emptied, the
# pipeline's case here and the torchrun one fail)
STOPPED = [("rpc_rl", 0), ("pipelining_transformer", 0)]


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
    for pid in children(launcher):
        if script.encode() in cmdline(pid) and b"torch.distributed.run" not in cmdline(pid):
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
        assert job.finish(timeout=HANG_TIMEOUT + MARGIN + TORCHRUN_GRACE + 30) != 0, job.text()
        # rank 0 names rank 1 and exits; torchrun's agent then ends the stopped rank 1 (SIGTERM, which a
        # stopped process cannot take, then SIGKILL): within about a minute (docs/failures.md)
        assert time.monotonic() - start < HANG_TIMEOUT + MARGIN + TORCHRUN_GRACE, job.text()
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


def hang_timeout_of(argv: list[str]) -> float:
    """--hang_timeout of the command ``python argv`` as its example's check_args leaves it."""
    import importlib

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


# ------------------------------------------------ the watchdog itself fails: it cannot die quietly

class _Store:
    """A stand-in for the job's store: answers like a TCPStore until ``fail`` is set, then
    raises (its host gone) or blocks (its host frozen) on every call."""

    def __init__(self, fail_how: str) -> None:
        self.fail_how, self.fail, self.data = fail_how, threading.Event(), {}

    def _maybe_fail(self) -> None:
        if self.fail.is_set():
            if self.fail_how == "raises":
                raise RuntimeError("Connection reset by peer")
            threading.Event().wait()  # frozen: never answers

    def set(self, key, value):
        self._maybe_fail()
        self.data[key] = str(value).encode()

    def add(self, key, n):
        self._maybe_fail()
        self.data[key] = str(int(self.data.get(key, b"0")) + n).encode()
        return int(self.data[key])

    def check(self, keys):
        self._maybe_fail()
        return all(k in self.data for k in keys)


def _watchdog_in_process(monkeypatch, store: _Store, rank: int) -> tuple[watchdog.Watchdog, threading.Event, list]:
    """Rank ``rank`` of two's watchdog on ``store``, started in this process: its exit ends only the calling
    thread and sets the event; the reports (then the exit status) go to the list."""
    monkeypatch.setattr(watchdog, "connect", lambda timeout: store)
    exited, reports = threading.Event(), []

    def fake_exit(status: int) -> None:
        reports.append(status)
        exited.set()
        raise SystemExit

    monkeypatch.setattr(watchdog, "_exit", fake_exit)
    return watchdog.Watchdog(rank=rank, world_size=2, timeout=1.0, on_hang=reports.append).start(), exited, reports


def test_a_silent_peer_is_named_from_its_heartbeat_and_nothing_is_killed(monkeypatch):
    """Rank 0 of two, in one process: rank 1 beat once and then fell silent. Rank 0 names it and ends
    itself; it writes only its own keys, no process id, and kills nothing (its launcher ends rank 1)."""
    store = _Store("never")
    store.add("distkit/watchdog/alive/1", 1)  # rank 1 started, then stopped
    monkeypatch.setattr(watchdog, "PEER_WAIT", 0.5)
    monkeypatch.setattr(os, "kill", lambda *a: pytest.fail(f"the watchdog killed {a}"))
    dog, exited, reports = _watchdog_in_process(monkeypatch, store, rank=0)
    try:
        dog.tick()  # progress: only the silent peer can be the reason
        assert exited.wait(10), "rank 0 did not notice its silent peer"
    finally:
        dog._stop.set()
    assert reports[-1] == 1 and "rank 1 stopped answering" in reports[0], reports
    prefix = "distkit/watchdog/"  # rank 0's own keys, and rank 1's beat, which it only read
    assert set(store.data) <= {f"{prefix}progress", f"{prefix}alive/0", f"{prefix}stacked/0", f"{prefix}alive/1"}, \
        store.data


@pytest.mark.parametrize("fail_how", ["raises", "blocks"])
def test_the_watchdog_ends_its_rank_when_the_store_fails(fail_how, monkeypatch):
    """In one process: the store the watchdog talks to starts failing under it. Before issue
    29 a raising store ended the watchdog's thread after its report (the rank trained on)
    and a frozen one held it for the client's timeout (120 s); now the rank exits 1 with its
    report within the store's bound plus one interval."""
    store = _Store(fail_how)
    monkeypatch.setattr(watchdog, "STORE_FLOOR", 1.0)  # a store call's bound: 1 s, not 10
    dog, exited, reports = _watchdog_in_process(monkeypatch, store, rank=1)
    try:
        time.sleep(0.5)
        assert not exited.is_set(), reports  # a working store: nothing happens
        store.fail.set()
        start = time.monotonic()
        assert exited.wait(10), f"the rank still runs 10 s after its store failed ({fail_how})"
        took = time.monotonic() - start
    finally:
        dog._stop.set()
    (message, status) = reports
    assert status == 1
    assert took < 1.0 + 2 * dog.interval + 1, took  # store bound + the guard's interval + slack
    expected = "the hang watchdog failed" if fail_how == "raises" else "has not answered for"
    assert message.startswith("rank 1: ") and expected in message, message


class _FreezesOnReport(_Store):
    """Answers until the watchdog's report writes its first key, then never again."""

    def set(self, key, value):
        if "stacked/" in key:
            self.fail.set()
        super().set(key, value)


def test_a_store_that_freezes_during_the_report_still_leaves_its_line(monkeypatch):
    """Rank 0 sees its peer fall silent and reports; the store freezes at the report's first write (its
    host frozen just then). The report's line still reaches the launcher, and the rank exits 1 within the
    peers' wait, not by the store's bound with its stack alone."""
    store = _FreezesOnReport("blocks")
    store.add("distkit/watchdog/alive/1", 1)  # rank 1 started, then stopped
    monkeypatch.setattr(watchdog, "PEER_WAIT", 0.5)
    dog, exited, reports = _watchdog_in_process(monkeypatch, store, rank=0)
    try:
        dog.tick()
        assert exited.wait(20), "rank 0 did not end"
    finally:
        dog._stop.set()
    assert store.fail.is_set() and reports[-1] == 1, reports
    assert len(reports) == 2 and "the job is stuck: rank 1 stopped answering" in reports[0], reports


@pytest.mark.timeout(300)
def test_a_frozen_store_host_ends_every_rank():
    """torchrun's agent hosts the job's store: frozen (SIGSTOP) under a running job, as the
    machine holding it would be when it drops off the network, every rank ends within the
    store's bound (``watchdog.STORE_FLOOR`` here) with a report saying so."""
    job = Job(("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "tests/hang_worker.py", "slow", "--seconds", "600", "--hang_timeout", "5"))
    try:
        job.wait_for(r"rank 1 made progress")
        job.wait_for(r"rank 0 made progress")
        workers = torchrun_workers(job.proc.pid, "tests/hang_worker.py")
        start = time.monotonic()
        os.kill(job.proc.pid, signal.SIGSTOP)  # the agent, and the store it hosts
        assert_all_gone(list(workers.values()), within=watchdog.STORE_FLOOR + MARGIN)
        took = time.monotonic() - start
        os.kill(job.proc.pid, signal.SIGCONT)
        assert job.finish(timeout=60) != 0, job.text()
        text = job.text()
        assert took < watchdog.STORE_FLOOR + MARGIN, text
        for rank in workers:
            assert f"rank {rank}: the job's rendezvous store has not answered for" in text, text
            assert f"[rank {rank}] stacks (every thread)" in text, text
    finally:
        if job.proc.poll() is None:
            os.kill(job.proc.pid, signal.SIGCONT)
        job.kill()
