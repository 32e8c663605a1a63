"""distkit: rank ranges, device choice, and a job that fails ending cleanly and loudly."""
from __future__ import annotations

import argparse
import ast
import json
import os
import signal
import subprocess
import sys
import threading
import time

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import distkit
from conftest import REPO, alive, checked_args, refused_before_launch, run_cli, run_torchrun

MAX_LINES = 300  # distkit is the little every example needs, not a framework


def launch_args(*argv: str, world_size: int = 2) -> argparse.Namespace:
    parser = distkit.ArgumentParser()
    distkit.add_launch_args(parser, world_size=world_size, rpc_timeout=60)
    parser.add_argument("--pid_dir", default=None)
    args = parser.parse_args(list(argv))
    distkit.check_launch_args(parser, args, min_world_size=1)
    return args


def package_imports(package: Path) -> dict[str, set[str]]:
    """Which modules of ``package`` each of its modules imports, at any depth of its code
    (under ``if TYPE_CHECKING:`` too: a circle of type hints is a circle a reader follows)."""
    name = package.name
    graph = {}
    for path in package.glob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:  # from .x import y / from . import x
                found.update([node.module.split(".")[0]] if node.module else [a.name for a in node.names])
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(f"{name}."):
                found.add(node.module.split(".")[1])
            elif isinstance(node, ast.ImportFrom) and node.module == name:  # from pkg import mod
                found.update(a.name for a in node.names if (package / f"{a.name}.py").is_file())
            elif isinstance(node, ast.Import):
                found.update(a.name.split(".")[1] for a in node.names if a.name.startswith(f"{name}."))
        graph[path.stem] = found - {path.stem}
    return graph


def import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (module names, the first repeated last), or None."""
    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return path[path.index(node):] + [node]
        for nxt in sorted(graph.get(node, ())):
            cycle = visit(nxt, path + [node])
            if cycle:
                return cycle
        return None
    for start in sorted(graph):
        cycle = visit(start, [])
        if cycle:
            return cycle
    return None


PACKAGES = ["distkit", "rpc_rl", "ddp_rpc", "rpc_rnn", "rpc_pipeline_resnet", "pipelining_transformer"]


@pytest.mark.fast
@pytest.mark.parametrize("name", PACKAGES)
def test_no_package_has_an_import_circle(name):
    assert import_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # can fail
    graph = package_imports(REPO / name)
    assert import_cycle(graph) is None, f"{name}: {' -> '.join(import_cycle(graph))}"


def test_the_import_graph_sees_every_kind_of_import(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import x\n")
    (pkg / "b.py").write_text("import pkg.c\n")
    (pkg / "c.py").write_text("from pkg import a\nfrom . import b\n")
    assert package_imports(pkg) == {"a": {"b"}, "b": {"c"}, "c": {"a", "b"}}
    assert import_cycle(package_imports(pkg)) == ["a", "b", "c", "a"]


def imported_packages(package: Path) -> set[str]:
    """The top-level names ``package``'s modules import (absolute imports, at any depth)."""
    found = set()
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
            elif isinstance(node, ast.Import):
                found.update(a.name.split(".")[0] for a in node.names)
    return found


@pytest.mark.fast
@pytest.mark.parametrize("name", PACKAGES[1:])
def test_no_example_imports_another(name):
    """What one example needs lives in it or in distkit: an example can be read,
    copied or moved alone. distkit imports no example either."""
    assert imported_packages(REPO / "distkit").isdisjoint(PACKAGES[1:])
    others = imported_packages(REPO / name) & (set(PACKAGES[1:]) - {name})
    assert not others, f"{name} imports {sorted(others)}"


@pytest.mark.fast
def test_distkit_is_small():
    package = REPO / "distkit"
    long = {p.name: n for p in package.glob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"distkit files over {MAX_LINES} lines: {long}"


def test_parse_ranks():
    assert distkit.parse_ranks(None, 3) == [0, 1, 2]
    assert distkit.parse_ranks("2", 4) == [2]
    assert distkit.parse_ranks("1-3", 4) == [1, 2, 3]
    for bad in ("3-1", "0-4", "x", "-1"):
        with pytest.raises(ValueError):
            distkit.parse_ranks(bad, 4)


def test_cpu_is_chosen_without_gpus():
    assert distkit.pick_device("cpu") == torch.device("cpu")
    assert distkit.pick_device("auto", min_gpus=10**6) == torch.device("cpu")
    assert distkit.backend_for(torch.device("cpu")) == "gloo"
    assert distkit.backend_for(torch.device("cuda", 1)) == "nccl"


@pytest.mark.fast
def test_workers_round_differently(workers_round_differently):
    """conftest's fixture holds: a process a test starts runs ATen's kernels one vector width
    narrower than the test's own, so the parity tests compare across roundings."""
    native = torch.backends.cpu.get_cpu_capability()
    child = run_cli("-c", "import torch; print(torch.backends.cpu.get_cpu_capability())")
    assert child.returncode == 0, child.stderr
    if workers_round_differently is None:
        pytest.skip(f"this CPU ({native}) has no second kind of kernels the check uses")
    assert child.stdout.strip() == workers_round_differently.upper() != native


def _collective_worker(worker: distkit.Worker, args: argparse.Namespace) -> dict:
    dist.init_process_group("gloo")
    t = torch.tensor([float(worker.rank + 1)])
    dist.all_reduce(t)
    return {"sum": t.item(), "threads": torch.get_num_threads(), "world": worker.world_size}


@pytest.mark.fast  # also on Python 3.10 and 3.13 (.ci/run)
def test_launch_runs_every_rank_and_returns_results():
    out = distkit.launch(_collective_worker, launch_args("--world_size", "3", "--threads", "1"))
    assert sorted(out) == [0, 1, 2]
    assert all(r == {"sum": 6.0, "threads": 1, "world": 3} for r in out.values())


def _large_result(worker: distkit.Worker, args: argparse.Namespace) -> torch.Tensor:
    return torch.full((1 << 20,), float(worker.rank))  # 4 MiB: many times a pipe's buffer


@pytest.mark.timeout(90)
def test_a_large_result_comes_back_from_a_rank_that_has_exited():
    """Each rank's result is read while the job joins (written whole, it would wait on a full
    pipe for ever), as bytes: a tensor shared the way multiprocessing shares it dies with its rank."""
    out = distkit.launch(_large_result, launch_args("--world_size", "2", "--threads", "1"))
    assert sorted(out) == [0, 1]
    assert all(torch.equal(out[r], torch.full((1 << 20,), float(r))) for r in out)


@pytest.mark.timeout(90)
def test_the_job_ends_its_own_ranks_and_no_other_process(tmp_path):
    """An interrupted or failed job ends the processes it started, not every child of the launcher
    (this test's process stands in for a program that launches a job beside work of its own)."""
    import multiprocessing

    bystander = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,))
    bystander.start()
    try:
        args = launch_args("--pid_dir", str(tmp_path))
        args.how = "raise"
        with pytest.raises(SystemExit):
            distkit.launch(_failing_worker, args)
        assert bystander.is_alive()
    finally:
        bystander.kill()
        bystander.join()


def _whereabouts(worker: distkit.Worker, args: argparse.Namespace) -> dict:
    print(f"rank {worker.rank} writes to the launcher's stdout", flush=True)
    return {"parent": os.getppid(), "variable": os.environ.get("DISTKIT_TEST_VARIABLE"),
            "capability": torch.backends.cpu.get_cpu_capability()}


@pytest.mark.fast
def test_ranks_forked_from_the_server_see_the_launch_environment(ranks_forked_from_a_server,
                                                                  workers_round_differently, monkeypatch, capfd):
    """conftest's server holds: the ranks of ``distkit.launch`` here are its children, not this
    process's, and still get this process's variables of the moment (a test's monkeypatch), its
    stdout of the moment (``capfd``'s), and the kernels ``workers_round_differently`` gives every
    process a test starts."""
    monkeypatch.setenv("DISTKIT_TEST_VARIABLE", "set by this test")
    out = distkit.launch(_whereabouts, launch_args("--world_size", "2", "--threads", "1"))
    assert [r["variable"] for r in out.values()] == ["set by this test"] * 2
    printed = capfd.readouterr().out
    assert all(f"rank {r} writes to the launcher's stdout" in printed for r in (0, 1)), printed
    assert all((r["parent"] != os.getpid()) == ranks_forked_from_a_server for r in out.values())
    if workers_round_differently is not None:
        assert all(r["capability"] == workers_round_differently.upper() for r in out.values())


def _failing_worker(worker: distkit.Worker, args: argparse.Namespace) -> None:
    with open(os.path.join(args.pid_dir, f"{worker.rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    if worker.rank == 1:
        if args.how == "raise":
            raise ValueError("boom from rank 1")
        os.kill(os.getpid(), signal.SIGKILL)
    dist.init_process_group("gloo")  # rank 0 would wait here for rank 1 forever
    dist.barrier()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how, message", [("raise", "rank 1 failed"),
                                          ("kill", "rank 1 died (signal SIGKILL)")])
def test_failed_rank_stops_the_job_loudly(how, message, tmp_path, capsys):
    args = launch_args("--pid_dir", str(tmp_path))
    args.how = how
    with pytest.raises(SystemExit) as exc:
        distkit.launch(_failing_worker, args)
    assert exc.value.code == 1
    err = capsys.readouterr().err
    assert message in err
    if how == "raise":
        assert err.count("ValueError: boom from rank 1") == 1  # the traceback, once
        assert "Traceback" in err
    # no worker is left behind
    for pid_file in tmp_path.glob("*.pid"):
        pid = int(pid_file.read_text())
        deadline = time.time() + 10
        while time.time() < deadline and _alive(pid):
            time.sleep(0.1)
        assert not _alive(pid), f"worker {pid_file.stem} survived"


def _interrupt_the_launcher(worker: distkit.Worker, args: argparse.Namespace) -> None:
    Path(args.pid_dir, f"{worker.rank}.pid").write_text(str(os.getpid()))
    while worker.rank == 0 and len(list(Path(args.pid_dir).glob("*.pid"))) < worker.world_size:
        time.sleep(0.05)
    if worker.rank == 0:
        os.kill(args.launcher, signal.SIGTERM)
    time.sleep(60)


@pytest.mark.timeout(90)
def test_sigterm_to_an_in_process_launcher_ends_its_ranks(tmp_path, capsys):
    """SIGTERM to a launcher that goes on living, a test or a benchmark: the job ends
    its ranks itself (a CLI's ranks would also die with it; these, forked from the server, not)."""
    args = launch_args("--pid_dir", str(tmp_path))
    args.launcher = os.getpid()
    with pytest.raises(SystemExit) as exc:
        distkit.launch(_interrupt_the_launcher, args)
    assert exc.value.code == 143  # 128 + SIGTERM, as a shell reports it
    assert "error: terminated (SIGTERM); all workers stopped" in capsys.readouterr().err
    pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
    assert len(pids) == 2 and not [pid for pid in pids if _alive(pid)], "a rank survived"


def _deaf_to_sigint(worker: distkit.Worker, args: argparse.Namespace) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # mp.spawn's own signal when the launcher dies
    Path(args.pid_dir, "rank.pid").write_text(str(os.getpid()))
    time.sleep(120)


DEAF = ("import sys; sys.path[:0] = ['tests']; import distkit, test_distkit; distkit.launch("
        "test_distkit._deaf_to_sigint, test_distkit.launch_args('--pid_dir', sys.argv[1], world_size=1))")


@pytest.mark.timeout(120)
def test_a_sigkilled_launcher_takes_along_a_rank_that_ignores_sigint(tmp_path):
    """The parent-death signal is distkit's SIGKILL, not only mp.spawn's SIGINT, which a rank busy in
    C++ takes late (or, as here, never). A spawned launcher: a forked rank's parent is the server."""
    launcher = subprocess.Popen([sys.executable, "-c", DEAF, str(tmp_path)], cwd=REPO)
    try:
        deadline = time.monotonic() + 90
        while not (tmp_path / "rank.pid").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        rank = int((tmp_path / "rank.pid").read_text())
        launcher.kill()
        deadline = time.monotonic() + 10
        while alive(rank) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(rank), "the rank outlived its launcher"
    finally:
        launcher.kill()
        launcher.wait()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("launcher", ["spawned", "torchrun"])
def test_a_rank_exits_0_while_a_gloo_collective_of_its_finishes(launcher):
    # tests/late_collective.py: gloo's thread takes the GIL while rank 0's interpreter would be
    # finalizing; a finished job must not be reported as killed by SIGABRT
    if launcher == "spawned":
        job = run_cli("tests/late_collective.py", timeout=90)
    else:
        job = run_torchrun(2, "tests/late_collective.py", timeout=90)
    assert job.returncode == 0, job.stdout + job.stderr
    assert "terminate called" not in job.stderr
    assert job.stdout.count("job finished") == (1 if launcher == "spawned" else 2)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("argv, message", [
    (["--world_size", "0"], "--world_size must be at least 1"),
    (["--master_port", "70000"], "argument --master_port: must be in 1..65535, got 70000"),
    (["--ranks", "1-2"], "--ranks 1-2 is not within 0..1"),
    (["--ranks", "1"], "a job over several machines (--ranks) needs --master_addr"),
    (["--ranks", "0"], "a job over several machines (--ranks) needs --master_addr"),  # its store: 127.0.0.1
    # a name of this machine's that resolves to loopback (Debian's 127.0.1.1): other machines cannot reach it
    (["--ranks", "0", "--master_addr", "localhost"], "--master_addr localhost resolves to a loopback address"),
    (["--ranks", "1", "--master_addr", "127.0.1.1", "--master_port", "29400"], "resolves to a loopback address"),
    (["--rpc_timeout", "nan"], "argument --rpc_timeout: must be a positive number"),
    (["--rpc_timeout", "inf"], "argument --rpc_timeout: must be a positive number"),
])
def test_bad_launch_flags_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        launch_args(*argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_torchrun_world_size_wins_over_the_default_not_over_the_flag(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert launch_args(world_size=2).world_size == 3  # torchrun --nproc_per_node 3
    assert launch_args("--world_size", "3").world_size == 3
    with pytest.raises(SystemExit) as exc:
        launch_args("--world_size", "2")  # typed by the user, and wrong
    assert exc.value.code == 2
    assert "disagrees with torchrun's WORLD_SIZE=3" in capsys.readouterr().err


def test_master_addr_not_on_this_machine_is_one_line_exit_2(capsys):
    # 192.0.2.0/24 is reserved for documentation: never an address of this machine
    args = launch_args("--master_addr", "192.0.2.1", "--master_port", "29999", "--ranks", "0-1")
    with pytest.raises(SystemExit) as exc:
        distkit.launch(_collective_worker, args)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot listen on 192.0.2.1:29999" in err, err


def _raise_then_peer_killed(worker: distkit.Worker, args: argparse.Namespace) -> None:
    raised = os.path.join(args.pid_dir, "raised")
    if worker.rank == 0:
        open(raised, "w").close()
        raise RuntimeError("rank 0 lost its peer")  # what the peer's death would make it raise
    while not os.path.exists(raised):
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.timeout(90)
def test_a_rank_killed_as_its_peer_fails_is_the_root_cause(tmp_path, capsys):
    """A killed rank can be reaped after the peer it broke has already raised (seen in CI:
    ddp_rpc's SIGKILLed parameter server reported as the master's RPC error): a rank that
    raises waits ``PEER_GRACE`` before it exits, so the kill is what mp.spawn sees first.
    With ``PEER_GRACE = 0`` this test fails (rank 0's traceback is reported)."""
    with pytest.raises(SystemExit):
        distkit.launch(_raise_then_peer_killed, launch_args("--pid_dir", str(tmp_path)))
    err = capsys.readouterr().err
    assert "rank 1 died (signal SIGKILL); the job is stopped" in err, err


@pytest.mark.fast  # also on Python 3.10 and 3.13 (.ci/run)
def test_the_profiler_records_every_thread(tmp_path):
    """distkit.profiled's private option (distkit/profiling.py, the one place it is named)
    still exists and still records a thread other than the one that started the profiler,
    as an RPC shard's work is; without the option this fails."""
    go = threading.Event()

    def work() -> None:
        go.wait()
        with torch.profiler.record_function("on another thread"):
            torch.mm(torch.ones(8, 8), torch.ones(8, 8))

    thread = threading.Thread(target=work)
    thread.start()
    with distkit.profiled(str(tmp_path), "rank0"):
        go.set()
        thread.join()
    events = json.loads((tmp_path / "rank0.json").read_text())["traceEvents"]
    assert any(e.get("name") == "on another thread" for e in events)


def _sleeps(worker: distkit.Worker, args: argparse.Namespace) -> None:
    time.sleep(120)


def _holds_the_gil(worker: distkit.Worker, args: argparse.Namespace) -> None:
    import re

    from distkit import watchdog

    watchdog.TIMER_MARGIN = 0.0  # faulthandler's timer: --hang_timeout after the watchdog's last round
    time.sleep(0.5)
    re.match(r"(a+)+$", "a" * 64 + "b")  # catastrophic backtracking in C, the GIL held throughout


@pytest.mark.timeout(60)
def test_a_rank_that_holds_the_gil_ends_with_its_stack(capfd):
    """A rank whose interpreter is frozen (one C call holding the GIL) runs none of the watchdog's
    Python threads: faulthandler's C timer, which the watchdog renews each round, prints its stack and ends it."""
    start = time.monotonic()
    with pytest.raises(SystemExit):
        distkit.launch(_holds_the_gil, launch_args("--hang_timeout", "1", world_size=1))
    err = capfd.readouterr().err  # faulthandler writes to the rank's file descriptor 2
    assert "rank 0 died (exit status 1)" in err and "in _holds_the_gil" in err, err
    assert time.monotonic() - start < 30


def _raise_while_peer_stopped(worker: distkit.Worker, args: argparse.Namespace) -> None:
    stopped = Path(args.pid_dir, "stopped.pid")
    if worker.rank == 1:
        stopped.write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)  # lost to its peers, not dead
        time.sleep(60)
        return
    while _proc_state(stopped) != "T":
        time.sleep(0.05)
    raise RuntimeError("rank 0 gave up on its stopped peer")  # as an RPC timeout would


def _proc_state(pid_file: Path) -> str | None:
    """The state /proc gives the process whose pid the file holds (T: stopped), or None."""
    try:
        return Path(f"/proc/{int(pid_file.read_text())}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, ValueError):  # not written yet
        return None


@pytest.mark.timeout(90)
def test_a_stopped_rank_is_ended_with_the_job(tmp_path, capsys):
    """A rank stopped (SIGSTOP) when its peer fails cannot take mp.spawn's SIGTERM, which
    would wait 30 s for it; the job's join gives it ``GRACE`` s, then SIGKILL."""
    args = launch_args("--pid_dir", str(tmp_path))
    start = time.monotonic()
    with pytest.raises(SystemExit):
        distkit.launch(_raise_while_peer_stopped, args)
    took = time.monotonic() - start
    assert "rank 0 failed" in capsys.readouterr().err
    assert took < 20, f"the job took {took:.0f} s to end"


def _raises_then_blocks_in_its_cleanup(worker: distkit.Worker, args: argparse.Namespace) -> None:
    import distkit.worker

    torch.nn.Linear(1, 1)(torch.ones(1))  # progress: the watchdog's start-up bound is over
    if worker.rank == 1:
        distkit.worker.cleanup = lambda graceful=True: time.sleep(120)  # as a peer that never answers
        raise ValueError("boom before the hang")
    time.sleep(120)  # waits on rank 1, which never comes


@pytest.mark.timeout(90)
def test_a_failure_recorded_before_a_hang_is_in_the_report(capsys):
    """Rank 1 raises, then blocks in its cleanup: the watchdog then reports a hang, later. The report
    has both, the failure's traceback first (before: the hang alone, the traceback never shown)."""
    with pytest.raises(SystemExit):
        distkit.launch(_raises_then_blocks_in_its_cleanup, launch_args("--hang_timeout", "2", "--threads", "1"))
    err = capsys.readouterr().err
    assert "ValueError: boom before the hang" in err and "the job is stuck" in err, err
    assert err.index("ValueError: boom before the hang") < err.index("the job is stuck"), err


@pytest.mark.parametrize("step_tasks, refused", [("2", True), ("abc", True), ("1", False), (None, False)])
def test_several_srun_tasks_outside_torchrun_are_refused_with_the_command_that_works(
        step_tasks, refused, capsys, monkeypatch):
    """``srun -n 2 python X/main.py``: each task would run a whole job of its own; one line shows the
    ``srun torchrun`` that works, exit 2. ``srun -n 1`` and an sbatch script's own shell (SLURM_NTASKS, no
    step) run as anywhere else."""
    from rpc_rnn.main import main

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_STEP_NUM_TASKS"):  # not under torchrun
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "2")
    if step_tasks is not None:
        monkeypatch.setenv("SLURM_STEP_NUM_TASKS", step_tasks)
    if refused:
        message = refused_before_launch(main, [], capsys, monkeypatch)
        assert f"srun started {step_tasks} tasks of " in message, message
        assert "srun --ntasks-per-node 1 .venv/bin/torchrun --nnodes $SLURM_NNODES" in message, message
    else:
        checked_args("rpc_rnn.main")  # no refusal


def _dies_half_way_through_its_result(worker: distkit.Worker, args: argparse.Namespace) -> dict | None:
    """Rank 0 is killed half-way through writing its result's record; rank 1 lives on for a minute."""
    if worker.rank == 1:
        time.sleep(60)
        return None

    def half_then_killed(obj: object, path: str) -> None:
        with open(path, "wb") as out:
            out.write(b"half a record")
        os.kill(os.getpid(), signal.SIGKILL)

    torch.save = half_then_killed  # in this rank's process only
    return {"result": "x" * 1000}


@pytest.mark.timeout(90)
def test_a_rank_killed_half_way_through_a_record_is_reported_at_once(capsys):
    """The record left half written must neither blind the launcher (its join sees the death; with the
    records read from a pipe on the main thread: only once the peer had exited, a minute later) nor be
    read as one (it is no record: the report is the death)."""
    start = time.monotonic()
    with pytest.raises(SystemExit):
        distkit.launch(_dies_half_way_through_its_result, launch_args("--threads", "1", "--hang_timeout", "0"))
    assert "rank 0 died (signal SIGKILL)" in capsys.readouterr().err
    assert time.monotonic() - start < 30


class _Unpicklable:
    def __reduce__(self):
        raise TypeError("cannot pickle this result")


def _returns_what_cannot_be_pickled(worker: distkit.Worker, args: argparse.Namespace) -> object:
    return _Unpicklable() if worker.rank == 0 else None


@pytest.mark.timeout(90)
def test_a_result_that_cannot_be_pickled_is_reported_with_its_reason(capsys):
    """Raised outside run_rank (the result's record), the error reaches mp.spawn's own wrapper, whose
    traceback the report carries (before: "rank 0 died (exit status 1)" and no reason)."""
    with pytest.raises(SystemExit):
        distkit.launch(_returns_what_cannot_be_pickled, launch_args("--threads", "1"))
    err = capsys.readouterr().err
    assert "rank 0 failed:" in err and "TypeError: cannot pickle this result" in err, err


def _fails_after_its_work(worker: distkit.Worker, args: argparse.Namespace) -> None:
    """Rank 0's work is done; what run_rank does after it (the job's store released) then fails."""
    import distkit.worker

    def store_gone(rank: int, world_size: int) -> None:
        raise ConnectionError("the job's store is gone")

    if worker.rank == 0:
        distkit.worker.release_store = store_gone  # in this rank's process only


@pytest.mark.timeout(90)
def test_a_failure_after_a_ranks_work_is_reported_with_its_reason(capsys):
    """Before: "rank 0 died (exit status 1)", the reason lost with the process."""
    with pytest.raises(SystemExit):
        distkit.launch(_fails_after_its_work, launch_args("--threads", "1"))
    err = capsys.readouterr().err
    assert "rank 0 failed:" in err and "ConnectionError: the job's store is gone" in err, err


def test_the_traceback_mp_spawn_kept_is_the_report():
    """An error before run_rank's guard (the parent-death signal, the environment) reaches mp.spawn's own
    wrapper, which keeps its traceback in a ProcessRaisedException: the report is that traceback."""
    from torch.multiprocessing.spawn import ProcessRaisedException

    job = distkit.Job(launch_args())
    trace = "Traceback (most recent call last):\n  ...\nOSError: prctl failed\n"
    exc = ProcessRaisedException(f"\n\n-- Process 1 terminated with the following error:\n{trace}", 1, 4242)
    assert job._root_cause(exc) == f"rank 1 failed:\n{trace.strip()}"
