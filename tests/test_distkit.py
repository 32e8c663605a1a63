"""distkit: its size and imports, the device choice, what each rank sets up for itself (threads, loopback
sockets, the parent-death signal with its race check, an end that skips the teardown), the launcher's
store and results, the launch flags' refusals and the profiler's private option. The failures of whole
jobs: tests/test_faults.py and tests/test_hangs.py."""
from __future__ import annotations

import argparse
import ast
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

import distkit
from conftest import REPO, assert_all_gone, checked_args, refused_before_launch, run_cli, run_torchrun

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


def test_cpu_is_chosen_without_gpus():
    assert distkit.pick_device("cpu") == torch.device("cpu")
    assert distkit.pick_device("auto", min_gpus=10**6) == torch.device("cpu")


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


def _collective_worker(rank: int, args: argparse.Namespace) -> dict:
    dist.init_process_group("gloo", rank=rank, world_size=args.world_size)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return {"sum": t.item(), "threads": torch.get_num_threads(), "world": args.world_size,
            "ifnames": (os.environ.get("GLOO_SOCKET_IFNAME"), os.environ.get("TP_SOCKET_IFNAME"))}


@pytest.mark.fast  # also on Python 3.10 and 3.13 (.ci/run)
def test_launch_runs_every_rank_and_returns_results():
    """Each rank as ``start_rank`` sets it up: --threads intra-op threads, and on a job whose rendezvous is
    on 127.0.0.1 gloo's and TensorPipe's sockets on the loopback interface (they listen on the network
    otherwise)."""
    out = distkit.launch(_collective_worker, launch_args("--world_size", "3", "--threads", "1"))
    assert sorted(out) == [0, 1, 2]
    loopback = ("lo", "lo") if "lo" in {name for _, name in socket.if_nameindex()} else (None, None)
    assert all(r == {"sum": 6.0, "threads": 1, "world": 3, "ifnames": loopback} for r in out.values()), out


def _threads(rank: int, args: argparse.Namespace) -> int:
    return torch.get_num_threads()


def test_the_ranks_share_the_cores_without_threads():
    """Without --threads, a rank's intra-op threads are this machine's cores divided among its ranks."""
    out = distkit.launch(_threads, launch_args("--world_size", "2"))
    assert out == {0: distkit.threads_per_process(2), 1: distkit.threads_per_process(2)}


def _large_result(rank: int, args: argparse.Namespace) -> torch.Tensor:
    return torch.full((1 << 20,), float(rank))  # 4 MiB: many times a pipe's buffer


@pytest.mark.timeout(90)
def test_a_large_result_comes_back_from_a_rank_that_has_exited():
    """A rank's result is a file, written whole before the rank ends (``distkit.save_result``): a tensor
    shared the way multiprocessing shares it dies with its rank."""
    out = distkit.launch(_large_result, launch_args("--world_size", "2", "--threads", "1"))
    assert sorted(out) == [0, 1]
    assert all(torch.equal(out[r], torch.full((1 << 20,), float(r))) for r in out)


def _whereabouts(rank: int, args: argparse.Namespace) -> dict:
    print(f"rank {rank} writes to the launcher's stdout", flush=True)
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


def _failing_worker(rank: int, args: argparse.Namespace) -> None:
    Path(args.pid_dir, f"{rank}.pid").write_text(str(os.getpid()))
    if rank == 1:
        deadline = time.monotonic() + 30  # rank 0's pid first: mp.spawn would end a rank 0 still starting
        while not Path(args.pid_dir, "0.pid").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if args.how == "raise":
            raise ValueError("boom from rank 1")
        os.kill(os.getpid(), signal.SIGKILL)
    dist.init_process_group("gloo", rank=rank, world_size=args.world_size)  # rank 0 waits here for rank 1
    dist.barrier()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["raise", "kill"])
def test_failed_rank_stops_the_job_loudly(how, tmp_path):
    """mp.spawn's own report: the rank's traceback (``ProcessRaisedException``), or the signal that ended it
    (``ProcessExitedException``); rank 0, blocked on it, is ended."""
    args = launch_args("--pid_dir", str(tmp_path))
    args.how = how
    with pytest.raises(ProcessRaisedException if how == "raise" else ProcessExitedException) as raised:
        distkit.launch(_failing_worker, args)
    report = str(raised.value)
    assert raised.value.error_index == 1, report
    if how == "raise":
        assert report.count("ValueError: boom from rank 1") == 1 and "Traceback" in report, report
    else:
        assert report == "process 1 terminated with signal SIGKILL", report
    pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
    assert len(pids) == 2
    assert_all_gone(pids, within=10)


@pytest.mark.timeout(90)
def test_a_failed_launch_ends_its_own_ranks_and_no_other_process(tmp_path):
    """A failed job ends the processes it started, not every child of the launcher (this test's process
    stands in for a program that launches a job beside work of its own)."""
    import multiprocessing

    bystander = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,))
    bystander.start()
    try:
        args = launch_args("--pid_dir", str(tmp_path))
        args.how = "raise"
        with pytest.raises(ProcessRaisedException):
            distkit.launch(_failing_worker, args)
        assert bystander.is_alive()
    finally:
        bystander.kill()
        bystander.join()


def _deaf_to_sigint(rank: int, args: argparse.Namespace) -> None:
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
        assert_all_gone([rank], within=10)
    finally:
        launcher.kill()
        launcher.wait()


RACE = "import sys; from distkit.rank import die_with_parent; die_with_parent(int(sys.argv[1])); print('alive')"


@pytest.mark.parametrize("parent", ["alive", "gone"])
def test_a_rank_whose_launcher_died_before_it_set_its_signal_ends_at_once(parent):
    """``die_with_parent``'s race check: a launcher that died before the rank's ``prctl`` sends no signal
    for it, so the rank, whose parent is now another process, SIGKILLs itself."""
    launcher = os.getpid() if parent == "alive" else 1  # pid 1: never this child's parent at the call
    child = run_cli("-c", RACE, str(launcher), timeout=60)
    if parent == "alive":
        assert child.returncode == 0 and child.stdout == "alive\n", child.stderr
    else:
        assert child.returncode == -signal.SIGKILL and child.stdout == "", child.stderr


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


@pytest.mark.timeout(120)
@pytest.mark.parametrize("launcher", ["spawned", "torchrun"])
def test_the_store_outlives_a_rank_that_is_done(launcher):
    # tests/late_rank.py: rank 1 writes to the job's store 5 s after rank 0 has ended
    if launcher == "spawned":
        job = run_cli("tests/late_rank.py", timeout=90)
    else:
        job = run_torchrun(2, "tests/late_rank.py", timeout=90)
    assert job.returncode == 0, job.stdout + job.stderr
    assert "rank 1 used the job's store 5 s after rank 0 was done" in job.stdout, job.stdout + job.stderr


@pytest.mark.parametrize("argv, message", [
    (["--world_size", "0"], "--world_size must be at least 1"),
    (["--rpc_timeout", "nan"], "argument --rpc_timeout: must be a positive number"),
    (["--rpc_timeout", "inf"], "argument --rpc_timeout: must be a positive number"),
    (["--hang_timeout", "-1"], "argument --hang_timeout: must be 0 (never) or a positive number"),
    (["--hang_timeout", "nan"], "argument --hang_timeout: must be 0 (never) or a positive number"),
    (["--threads", "0"], "argument --threads: must be at least 1"),
    (["--ranks", "0"], "unrecognized arguments: --ranks 0"),  # several machines: torchrun's
])
def test_bad_launch_flags_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        launch_args(*argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


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
