"""Failure behaviour of every example: fail fast and loudly, leave nothing behind, stay local.

Each example is started as a user would (``python X/main.py ...`` in its own session), left to
start or to train, and then broken: a rank killed with SIGKILL, the launcher sent SIGTERM or Ctrl+C,
a rank that raises, a peer that stops answering RPCs, the launcher killed. Meanwhile the listening
sockets of the job's processes are read: a run on one machine must listen on loopback only.
The reports are PyTorch's own: mp.spawn's exception (``ProcessRaisedException`` with the rank's
traceback, ``ProcessExitedException`` for a rank ended by a signal or an exit status), torchrun's
failure summary.
"""
from __future__ import annotations

import argparse
import importlib
import os
import re
import signal
import time
from pathlib import Path

import pytest
from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

import distkit
from conftest import EXAMPLES, Example, Job, assert_all_gone, module_of, run_cli, run_torchrun, workers_by_rank

ENDED = 10  # seconds within which a signal to the launcher ends every process of the job


def listening_addresses(pids: list[int]) -> set[str]:
    """Local addresses of the TCP sockets in LISTEN state that ``pids`` hold."""
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                m = re.fullmatch(r"socket:\[(\d+)\]", os.readlink(fd))
                if m:
                    inodes.add(m.group(1))
        except OSError:
            continue
    found = set()
    for table, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.add(_decode(fields[1].split(":")[0], width))
    return found


def _decode(hex_addr: str, width: int) -> str:
    import ipaddress

    raw = bytes.fromhex(hex_addr)
    # /proc/net/tcp prints each 32-bit word in host (little-endian) order
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(raw))


def _is_loopback(addr: str) -> bool:
    import ipaddress

    ip = ipaddress.ip_address(addr)
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


@pytest.fixture(params=sorted(EXAMPLES))
def example(request) -> tuple[str, Example]:
    return request.param, EXAMPLES[request.param]


# What the launch does with a killed rank, a signal, or its own death is the same for every script
# (mp.spawn after distkit.prepare_spawn): one RPC job and one process-group job cover it, and their
# sockets the two kinds of rendezvous (every example and its twin took about 3 of the suite's minutes)
LAUNCHER = ["pipelining_transformer", "rpc_rnn"]


@pytest.fixture(params=LAUNCHER)
def launched(request) -> tuple[str, Example]:
    return request.param, EXAMPLES[request.param]


@pytest.mark.timeout(300)
def test_sigkilled_worker_ends_the_job(launched):
    name, ex = launched
    job = Job(ex.argv)
    try:
        job.wait_for(ex.ready)
        workers = job.workers()
        assert len(workers) >= 2, job.text()
        # every socket the job listens on is on loopback: nothing is reachable from the network
        addresses = listening_addresses([job.proc.pid, *workers])
        assert addresses and all(map(_is_loopback, addresses)), addresses
        os.kill(workers[-1], signal.SIGKILL)  # the last one started: the highest rank
        assert job.finish(timeout=60) == 1, job.text()
        # mp.spawn's report: it ended the other ranks, and names the one killed
        assert f"ProcessExitedException: process {len(workers) - 1} terminated with signal SIGKILL" in job.text(), \
            job.text()
        assert_all_gone(job.processes(), within=10)
    finally:
        job.kill()


def _signalled(job: Job, sig: signal.Signals, ctrl_c: bool) -> None:
    """``sig`` to the launcher alone (``kill``), or to every process of the job, as a terminal's Ctrl+C."""
    if ctrl_c:
        os.killpg(job.proc.pid, sig)
    else:
        job.proc.send_signal(sig)


def _check_ends_at_once(job: Job, signals: list[tuple[signal.Signals, bool]]) -> None:
    """The signals, 0.2 s apart, end every process of ``job`` within ``ENDED`` s, the launcher by the first
    one (a shell reports 128 + it: 143, 130), and nothing prints a traceback."""
    processes = job.processes()
    for i, (sig, ctrl_c) in enumerate(signals):
        if i:
            time.sleep(0.2)
        _signalled(job, sig, ctrl_c)
    assert_all_gone(processes + job.processes(), within=ENDED)
    assert job.finish(timeout=ENDED) == -signals[0][0], job.text()
    assert "Traceback" not in job.text(), job.text()


# (the signals, True: to the job's process group, as Ctrl+C in a terminal; False: to the launcher alone)
SIGNALS = {"sigterm": [(signal.SIGTERM, False)], "ctrl+c": [(signal.SIGINT, True)],
           "sigterm-twice": [(signal.SIGTERM, False), (signal.SIGTERM, False)],
           "ctrl+c-then-sigterm": [(signal.SIGINT, True), (signal.SIGTERM, False)]}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["sigterm", "ctrl+c"])
def test_a_signal_while_mp_spawn_starts_the_ranks_ends_every_process(how):
    """The ranks are still importing torch, with no parent-death signal yet: before, they outlived a
    SIGTERMed launcher by 28 s (``rpc_rl/main.py --world_size 4``), and Ctrl+C, which reaches them
    too, made each print a KeyboardInterrupt traceback (distkit/launch.py's ``_end_on_signal``)."""
    job = Job(("rpc_rl/main.py", "--world_size", "4"))
    try:
        deadline = time.monotonic() + 60
        while len(job.workers()) < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(job.workers()) == 4, job.text()
        time.sleep(1)  # into torch's import (a signal in an interpreter's first milliseconds meets SIG_DFL)
        assert "[rank" not in job.text(), job.text()  # not started yet: no rank has printed
        _check_ends_at_once(job, SIGNALS[how])
    finally:
        job.kill()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", sorted(SIGNALS))
def test_a_signal_during_training_ends_every_process(how):
    # an RPC job: each rank has its agent's threads in C; a process group's ranks, blocked in gloo, are
    # ended alike (test_sigkilled_launcher_takes_ranks_blocked_in_a_collective_along)
    ex = EXAMPLES["rpc_rl"]
    job = Job(ex.argv)
    try:
        job.wait_for(ex.ready)
        _check_ends_at_once(job, SIGNALS[how])
    finally:
        job.kill()


@pytest.mark.timeout(300)
def test_a_signal_to_a_process_group_job_ends_every_process():
    ex = EXAMPLES["pipelining_transformer"]
    job = Job(ex.argv)
    try:
        job.wait_for(ex.ready)
        _check_ends_at_once(job, SIGNALS["sigterm"])
    finally:
        job.kill()


@pytest.mark.timeout(120)
def test_ctrl_c_to_torchrun_ends_its_workers():
    """torchrun's own handling stands: its workers, in sessions of their own, never see the terminal's
    Ctrl+C; the agent stops them and exits 1 (with its SignalException's traceback)."""
    job = Job(("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "tests/hang_worker.py",
               "slow", "--seconds", "600"))
    try:
        job.wait_for(r"rank 1 made progress")
        ranks = workers_by_rank(job.proc.pid)
        assert sorted(ranks) == [0, 1], job.text()
        os.killpg(job.proc.pid, signal.SIGINT)
        assert job.finish(timeout=60) == 1, job.text()
        assert_all_gone([*ranks.values(), *job.processes()], within=ENDED)
    finally:
        job.kill()


def _faulty_worker(rank: int, args: argparse.Namespace) -> None:
    """The example's own run_worker, with one function on one rank made to fail."""
    if rank == args.fault_rank:
        module_name, path = args.fault_target.split(":")
        owner = importlib.import_module(module_name)
        *parents, attr = path.split(".")
        for p in parents:
            owner = getattr(owner, p)
        original, calls = getattr(owner, attr), [0]

        def fail_on_second_call(*a, **kw):
            calls[0] += 1
            if calls[0] == 2:
                raise RuntimeError(f"injected fault in {path}")
            return original(*a, **kw)

        setattr(owner, attr, fail_on_second_call)
    importlib.import_module(args.example_module).run_worker(rank, args)


@pytest.mark.timeout(300)
def test_raising_worker_fails_the_job_with_its_traceback(example):
    name, ex = example
    module = importlib.import_module(module_of(name))
    parser = module.build_parser()
    args = parser.parse_args(list(ex.argv[1:]))
    module.check_args(parser, args)
    args.example_module, args.fault_rank, args.fault_target = module_of(name), ex.fault_rank, ex.fault_target
    with pytest.raises(ProcessRaisedException) as raised:
        distkit.launch(_faulty_worker, args)
    report = str(raised.value)
    # mp.spawn's report names the rank that raised, not an echo: directly, or (ddp_rpc's trainers run
    # inside the master's RPC) as the worker in whose RPC the error came back
    assert (raised.value.error_index == ex.fault_rank or f"On WorkerInfo(id={ex.fault_rank}," in report), report
    assert report.count("RuntimeError: injected fault") == 1 and "Traceback" in report, report


@pytest.mark.timeout(300)
@pytest.mark.parametrize("launcher", ["spawn", "torchrun"])
def test_a_raise_reaches_the_user_within_seconds_when_what_follows_it_blocks(launcher):
    """tests/hang_worker.py's raise: rank 1 raises with a thread of its own left running and an atexit
    function that never returns, and rank 0 waits on it in a recv. The raise ends rank 1 at once (mp.spawn's
    ``sys.exit`` and torchrun's uncaught exception end the process in distkit's ``start_rank``), not by
    --hang_timeout's 60 s: mp.spawn's report, or torchrun's summary naming rank 1 as its root cause."""
    argv = ("tests/hang_worker.py", "raise", "--hang_timeout", "60")
    if launcher == "spawn":
        job = Job(argv)
    else:
        # a poll of 2 s, not 0.1: the agent sees both ranks ended at once, and the root cause is the error
        # file stamped first (to the second: the raising rank exits LAST_WORDS s after its raise)
        job = Job(("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--monitor-interval=2",
                   *argv))
    try:
        job.wait_for(r"rank 1 raises", timeout=180)
        raised = time.monotonic()
        assert job.finish(timeout=60) == 1, job.text()
        took = time.monotonic() - raised
        text = job.text()
        assert took < 20, f"the job ended {took:.0f} s after the raise:\n{text}"
        if launcher == "spawn":
            assert "-- Process 1 terminated with the following error:" in text, text
            report = text[text.index("-- Process 1 terminated"):]
        else:
            report = text[text.index("Root Cause (first observed failure)"):]
            assert re.search(r"rank +: 1 \(local_rank: 1\)", report) and "error_file: <N/A>" not in report, text
        assert "ValueError: boom from rank 1, with what follows it blocked" in report, text
        assert "no progress" not in text, text  # no hang was reported: the raise ended it
    finally:
        job.kill()


@pytest.mark.timeout(300)
def test_four_runs_at_once_all_succeed():
    # Each job's port is picked by the OS: two RPC jobs and two process-group jobs at once cover both
    # kinds of rendezvous (each example four times took 2.5 minutes)
    jobs = [Job(EXAMPLES[name].quick) for name in LAUNCHER for _ in range(2)]
    try:
        statuses = [job.finish(timeout=280) for job in jobs]
        assert statuses == [0] * 4, "\n---\n".join(j.text()[-2000:] for j in jobs)
    finally:
        for job in jobs:
            job.kill()


LOST_PEER_RPC_TIMEOUT = 20
SPAWN_GRACE = 30  # mp.spawn gives the other ranks 30 s to take its SIGTERM, which a stopped one cannot


@pytest.mark.timeout(300)
def test_lost_rpc_peer_times_out_instead_of_hanging():
    # ddp_rpc's trainer stops answering (SIGSTOP, not dead: the launcher cannot see it); every RPC to
    # it, DDP's allreduce with it and the master's wait are bounded. The other RPC examples' RPCs get
    # --rpc_timeout from their options alone: test_rpc_examples_have_a_bounded_rpc_timeout
    ex = EXAMPLES["ddp_rpc"]
    # --rpc_timeout bounds every RPC, the set-up's too: 5 s failed DistributedOptimizer's construction on a
    # loaded 2-core machine, before any rank was stopped; it took 1.8-3.1 s with the whole suite
    # running beside it (measured). 20 s leaves that set-up 6x; the wait on the stopped trainer is bounded all the same
    job = Job((*ex.argv, "--rpc_timeout", str(LOST_PEER_RPC_TIMEOUT)))
    try:
        job.wait_for(ex.ready)
        workers = job.workers()
        # every RPC example listens on loopback only (the launcher's examples: the SIGKILL test)
        addresses = listening_addresses([job.proc.pid, *workers])
        assert addresses and all(map(_is_loopback, addresses)), addresses
        os.kill(workers[ex.hung_rank], signal.SIGSTOP)
        # the driver fails after --rpc_timeout; mp.spawn then SIGKILLs the stopped rank after its grace
        assert job.finish(timeout=LOST_PEER_RPC_TIMEOUT + SPAWN_GRACE + 90) == 1, job.text()
        assert "ProcessRaisedException" in job.text(), job.text()
        assert_all_gone(job.processes(), within=10)
    finally:
        job.kill()


class _Options(Exception):
    """What a patched ``rpc.init_rpc`` raises, with the options it was given."""


def _capture_options(*args, rpc_backend_options=None, **kwargs):
    raise _Options(rpc_backend_options)


@pytest.mark.parametrize("name", ["rpc_rl", "ddp_rpc", "rpc_rnn", "rpc_pipeline_resnet"])
def test_rpc_examples_have_a_bounded_rpc_timeout(name, monkeypatch):
    """Every RPC carries --rpc_timeout (a stopped peer ends the job, not a wait): the default is
    bounded, and the ranks init RPC with it."""
    module = importlib.import_module(f"{name}.main")
    args = module.build_parser().parse_args([])
    assert 0 < args.rpc_timeout <= 300
    args.rpc_timeout, args.world_size = 7.0, 2
    if name != "ddp_rpc":  # ddp_rpc: its lost peer is run above
        monkeypatch.setattr(distkit, "start_rank", lambda rank, args: None)  # this process is no rank
        monkeypatch.setattr("torch.distributed.rpc.init_rpc", _capture_options)
        for rank in (0, 1):
            with pytest.raises(_Options) as given:
                module.run_worker(rank, args)
            assert given.value.args[0].rpc_timeout == 7.0, (name, rank)


@pytest.mark.timeout(120)
def test_sigkilled_launcher_takes_ranks_blocked_in_a_collective_along():
    """Ranks blocked in gloo's recv run no bytecode, so mp.spawn's parent-death SIGINT never acts:
    distkit's SIGKILL (``die_with_parent``) ends them; without it this fails."""
    job = Job(("tests/hang_worker.py", "deadlock", "--hang_timeout", "0"))
    try:
        for rank in (0, 1):
            job.wait_for(rf"rank {rank} waits")
        processes = job.processes()
        time.sleep(1)  # into the recv
        job.proc.kill()
        assert_all_gone(processes, within=10)
    finally:
        job.kill()


@pytest.mark.timeout(300)
def test_sigkilled_launcher_takes_its_workers_along(launched):
    # no cleanup runs in the launcher: the ranks' parent-death signal is what ends them
    name, ex = launched
    job = Job(ex.argv)
    try:
        job.wait_for(ex.ready)
        processes = job.processes()
        job.proc.kill()
        assert_all_gone(processes, within=10)
    finally:
        job.kill()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [n for n, ex in sorted(EXAMPLES.items()) if ex.diverge])
def test_non_finite_loss_ends_the_run(name):
    # rpc_rl and rpc_pipeline_resnet: tests/test_rpc_rl.py, tests/test_rpc_pipeline_resnet.py
    ex = EXAMPLES[name]
    module = importlib.import_module(module_of(name))
    parser = module.build_parser()
    args = parser.parse_args([*ex.quick[1:], *ex.diverge])
    module.check_args(parser, args)
    with pytest.raises((ProcessRaisedException, ProcessExitedException)) as raised:
        distkit.launch(module.run_worker, args)
    assert re.search(r"FloatingPointError: the loss is (nan|inf|-inf) at ", str(raised.value)), str(raised.value)


@pytest.mark.timeout(300)
def test_a_ranks_exception_reaches_torchruns_own_summary():
    """Under torchrun, a rank's exception (a loss that turns non-finite) is in torchrun's failure summary,
    by PyTorch's ``@record`` around the rank (without it: ``error_file: <N/A>``, the traceback on stderr only)."""
    ex = EXAMPLES["pipelining_transformer"]
    flags = list(ex.quick[1:])
    del flags[flags.index("--world_size"):flags.index("--world_size") + 2]  # torchrun's
    proc = run_torchrun(2, ex.quick[0], *flags, *ex.diverge, "--threads", "1", timeout=240)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text
    summary = text[text.index("Root Cause (first observed failure)"):]
    assert "error_file: <N/A>" not in summary, text
    assert re.search(r"FloatingPointError: the loss is (nan|inf|-inf) at ", summary), text


@pytest.mark.timeout(120)
def test_a_killed_rank_ends_a_job_under_torchrun_too():
    """torchrun's own handling: rank 1 SIGKILLed, the agent ends rank 0 and exits non-zero within a minute."""
    job = Job(("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "tests/hang_worker.py",
               "slow", "--seconds", "600"))
    try:
        job.wait_for(r"rank 1 made progress")
        ranks = workers_by_rank(job.proc.pid)  # in sessions of their own: torchrun starts them so
        assert sorted(ranks) == [0, 1], job.text()
        os.kill(ranks[1], signal.SIGKILL)
        assert job.finish(timeout=60) != 0, job.text()
        assert_all_gone([*ranks.values(), *job.processes()], within=10)
    finally:
        job.kill()


@pytest.mark.timeout(120)
def test_a_bad_flag_is_one_line_and_exit_2_before_any_process_starts():
    proc = run_cli("rpc_rl/main.py", "--world_size", "1", timeout=100)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and "--world_size must be at least 2" in proc.stderr, proc.stderr
    assert proc.stdout == "", proc.stdout
