"""Multi-host runs without machines: network namespaces joined by a bridge stand in for hosts.

Each "host" is a network namespace with one veth interface (``eth0``, 10.231.0.i/24) on a
bridge that lives in a namespace of its own; nothing is added to this machine's own network
and no address outside those namespaces is used. Each host's command runs as the docs
(docs/multi_host.md) tell a user to run it on a real machine, under ``ip netns exec`` and
in a PID namespace of its own: TensorPipe copies tensors between processes that share a
PID namespace with process_vm_readv (its CMA channel) instead of sending them over TCP,
which real machines cannot do.

The runs must train exactly as on one host, compared with a single-host run of the same
configuration: ddp_rpc's per-rank results (each host runs ``ddp_rpc/main.py``'s ``main``
through ``_run_and_keep_results`` at the bottom of this file, which also saves what the
launcher returned), pipelining_transformer's printed and logged losses (one stage per host;
one dp replica per host; a torchrun restart on both hosts after a worker is SIGKILLed, against
an uninterrupted run). While they run, the listening
sockets of every host are read from /proc: distkit's processes bind where the user said
(``--master_addr``, ``GLOO_SOCKET_IFNAME``/``TP_SOCKET_IFNAME``), never on every interface.

Root is needed to create namespaces; elsewhere these tests skip with the reason.
"""
from __future__ import annotations

import argparse
import importlib
import json
import ipaddress
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch

import distkit
from conftest import (FLOAT32, IFNAME, PRINTED_4, REPO, Host, assert_equals_uninterrupted, children, cmdline,
                      ip as _ip, logged_losses, network_hosts, resumed_steps, run_cli, workers_by_rank)
from pipelining_transformer import checkpoint

SUBNET = "10.231.0"
# The hosts are fresh private namespaces, so any port is free in them: a fixed one per
# test (not one shared by all: a closed store's port may linger in TIME_WAIT).
DDP_RPC_PORT, C10D_PORT, STATIC_PORT, DP_PORT, ELASTIC_PORT, USED_UP_PORT = (
    29400, 29410, 29420, 29430, 29440, 29450)
HOST_TIMEOUT = 200  # seconds for all hosts of one run, start-up included (slow, shared CPUs)


@dataclass
class HostRun:
    host: Host
    returncode: int
    output: str
    listening: set[tuple[str, int]]  # (address, port) of every listening TCP socket seen


@pytest.fixture(scope="module")
def hosts():
    """Six hosts on one bridge (three, and three more for the hang cases' pairs); torn down after
    the module's tests, failed or not."""
    with network_hosts(f"mh{os.getpid()}", 6, SUBNET) as result:
        yield result


def _listening(pid: int, ns: str) -> set[tuple[str, int]]:
    """Listening TCP sockets of network namespace ``ns``, read through process ``pid``.

    Nothing until ``pid`` has entered ``ns``: ``ip netns exec`` starts in this machine's own
    namespace, whose sockets (other programs' servers on 0.0.0.0) are not the job's.
    """
    try:
        if os.readlink(f"/proc/{pid}/ns/net") != f"net:[{os.stat(f'/run/netns/{ns}').st_ino}]":
            return set()
    except OSError:  # the process is gone
        return set()
    found = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:  # the process is gone
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != "0A":  # TCP_LISTEN
                continue
            hex_addr, hex_port = fields[1].split(":")
            # each 32-bit word of the address is in the kernel's (little-endian) byte order
            raw = b"".join(bytes.fromhex(hex_addr[i:i + 8])[::-1] for i in range(0, len(hex_addr), 8))
            found.add((str(ipaddress.ip_address(raw)), int(hex_port, 16)))
    return found


def run_on_hosts(jobs: list[tuple[Host, list[str], dict[str, str]]], tmp_path: Path,
                 watch: Callable[[list[int]], None] | None = None) -> list[HostRun]:
    """Start ``python ARGV`` on every host at once (one command per host, as on real
    machines), watch their listening sockets, wait for all; kill all if they take too long.

    ``watch``, if given, is called with the hosts' pids (in this machine's PID namespace)
    every quarter of a second while any host runs: a test's hand in the run (a kill)."""
    procs = []
    for i, (host, argv, env) in enumerate(jobs):
        log = open(tmp_path / f"host{i}.log", "w")
        cmd = ["ip", "netns", "exec", host.ns, "unshare", "--pid", "--fork", "--kill-child",
               sys.executable, *argv]
        procs.append((subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                       env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
                                       start_new_session=True), log))
    listening: list[set[tuple[str, int]]] = [set() for _ in jobs]
    deadline = time.monotonic() + HOST_TIMEOUT
    try:
        while any(p.poll() is None for p, _ in procs) and time.monotonic() < deadline:
            for seen, (p, _), (host, _, _) in zip(listening, procs, jobs):
                if p.poll() is None:
                    seen |= _listening(p.pid, host.ns)
            if watch is not None:
                watch([p.pid for p, _ in procs])
            time.sleep(0.25)
    finally:
        timed_out = [i for i, (p, _) in enumerate(procs) if p.poll() is None]
        for p, log in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # the session this test started for it
            p.wait()
            log.close()
    runs = [HostRun(host, p.returncode, (tmp_path / f"host{i}.log").read_text(), seen)
            for i, ((host, _, _), (p, _), seen) in enumerate(zip(jobs, procs, listening))]
    if timed_out:
        pytest.fail(f"hosts {timed_out} still ran after {HOST_TIMEOUT} s:\n" + _outputs(runs))
    return runs


def _outputs(runs: list[HostRun]) -> str:
    return "\n".join(f"--- {r.host.ns} ({r.host.addr}), exit {r.returncode}:\n{r.output}"
                     for r in runs)


def _assert_all_succeeded(runs: list[HostRun]) -> None:
    assert all(r.returncode == 0 for r in runs), _outputs(runs)


def _assert_bound_to_own_address(run: HostRun, ignore_ports: tuple[int, ...] = ()) -> None:
    for addr, port in run.listening:
        if port in ignore_ports:
            continue
        assert addr == run.host.addr or ipaddress.ip_address(addr).is_loopback, (
            f"{run.host.ns} listens on {addr}:{port}, not on its own address {run.host.addr}")


def _make_args(build_parser, check_args, *argv: str) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(list(argv))
    check_args(parser, args)
    return args


# ---------------------------------------------------------------- ddp_rpc, 4 roles on 3 hosts

# One iteration: every trainer updates the shared table on the parameter server whenever
# its step gets there, so from the second iteration on a trainer's lookup may or may not
# see the other's last update, on one host as on three (the tutorial's asynchronous design).
# After one iteration everything is determined: both losses, fc (DDP-averaged) and the table.
# --threads 1 everywhere: a host's processes and the single-host reference then do the
# same arithmetic in the same order.
DDP_RPC = ("--world_size", "4", "--epochs", "1", "--batches_per_epoch", "1", "--batch_size", "8",
           "--seed", "2", "--lr", "0.5", "--threads", "1")
# host -> ranks: trainer0 (and the job's store) | trainer1 and the master | the parameter server.
# DDP's allreduce, the RPCs to the table and the distributed backward all cross hosts.
DDP_RPC_RANKS = ("0", "1-2", "3")
RPC_IFACES = {"GLOO_SOCKET_IFNAME": IFNAME, "TP_SOCKET_IFNAME": IFNAME}


def _printed(pattern: str, output: str) -> list[float]:
    return [float(x) for x in re.findall(pattern, output)]


def test_ddp_rpc_roles_spread_over_three_hosts(hosts, tmp_path):
    from ddp_rpc.main import build_parser, check_args, run_worker

    ref = distkit.launch(run_worker, _make_args(build_parser, check_args, *DDP_RPC))[2]
    # every machine runs the same command with its own --ranks and the master's address
    jobs = [(host, [__file__, str(tmp_path / f"host{i}.pt"), "ddp_rpc/main.py", *DDP_RPC,
                    "--ranks", ranks, "--master_addr", hosts[0].addr,
                    "--master_port", str(DDP_RPC_PORT)], RPC_IFACES)
            for i, (host, ranks) in enumerate(zip(hosts, DDP_RPC_RANKS))]
    runs = run_on_hosts(jobs, tmp_path)
    _assert_all_succeeded(runs)
    results = [torch.load(tmp_path / f"host{i}.pt", weights_only=False) for i in range(3)]
    assert [sorted(r) for r in results] == [[], [2], []]  # only the master returns something
    out = results[1][2]  # the master ran on host 2

    # trained as on one host: the same losses, the same DDP-averaged fc on both trainers,
    # the same embedding table after both trainers' steps
    for report, expected in zip(out["trainers"], ref["trainers"]):
        torch.testing.assert_close(report.losses, expected.losses, **FLOAT32)
        for name, p in expected.fc_after.items():
            torch.testing.assert_close(report.fc_before[name], expected.fc_before[name])
            torch.testing.assert_close(report.fc_after[name], p)
    torch.testing.assert_close(out["emb_before"], ref["emb_before"])
    torch.testing.assert_close(out["emb_after"], ref["emb_after"])
    assert not torch.equal(out["emb_after"], out["emb_before"])
    # and each trainer logged its loss on its own host (4 decimals)
    for rank, run in ((0, runs[0]), (1, runs[1])):
        printed = _printed(rf"\[rank {rank}\] Training done for epoch 0: loss ([\d.]+)", run.output)
        torch.testing.assert_close(printed, ref["trainers"][rank].losses[0], rtol=0, atol=PRINTED_4)
    assert "fc identical on all trainers: True" in runs[1].output

    # binds where the user said: the store on --master_addr, gloo and TensorPipe on the
    # interface the variables name; nothing on every interface
    assert (hosts[0].addr, DDP_RPC_PORT) in runs[0].listening, runs[0].listening
    for run in runs:
        assert run.listening, f"no listening socket seen on {run.host.ns}"
        _assert_bound_to_own_address(run)


def test_the_store_outlives_a_rank_on_another_host_that_still_needs_it(hosts, tmp_path):
    """Rank 0's launcher hosts the job's store; rank 1, on the second host, uses it 5 s after rank 0 is
    done (tests/late_rank.py). The launcher waits for it, as torchrun's agents do at their exit barrier:
    without that wait rank 1's write meets a closed store (once seen in CI as a rank whose rpc.shutdown()
    failed; here every time)."""
    jobs = [(host, ["tests/late_rank.py", "--ranks", str(rank), "--master_addr", hosts[0].addr,
                    "--master_port", str(USED_UP_PORT + 5), "--threads", "1"], RPC_IFACES)
            for rank, host in enumerate(hosts[:2])]
    runs = run_on_hosts(jobs, tmp_path)
    _assert_all_succeeded(runs)
    assert "rank 1 used the job's store 5 s after rank 0 was done" in runs[1].output, _outputs(runs)


# ------------------------------------------- pipelining_transformer, one stage per host

# a tiny model; dropout 0 and SGD as in test_pipelining_transformer's equivalence tests
TINY_MODEL = ("--dim", "16", "--n_heads", "2", "--n_layers", "2", "--vocab_size", "32",
              "--seq_len", "8", "--batch_size", "8", "--n_microbatches", "4", "--seed", "3",
              "--threads", "1")
PIPELINE = (*TINY_MODEL, "--world_size", "2", "--steps", "4", "--dropout", "0",
            "--optimizer", "sgd", "--lr", "0.1")
PIPELINE_IFACES = {"GLOO_SOCKET_IFNAME": IFNAME}  # no RPC: TensorPipe is not used


def _torchrun_argv(rendezvous: str, node: int, hosts: list[Host], port: int | None = None,
                   nproc: int = 1) -> list[str]:
    """The per-machine torchrun command of docs/multi_host.md for a 2-machine run."""
    argv = ["-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", str(nproc)]
    if rendezvous == "static":  # node_rank fixes which machine runs which ranks
        argv += ["--node_rank", str(node), "--master_addr", hosts[0].addr,
                 "--master_port", str(port or STATIC_PORT)]
    else:
        # the host names of these namespaces resolve to 127.0.0.1 (as on many Debian
        # machines, 127.0.1.1): say which machine hosts the rendezvous and what each
        # machine's address is, instead of letting torchrun guess from the host name
        argv += ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"{hosts[0].addr}:{port or C10D_PORT}",
                 "--local_addr", hosts[node].addr]
        if node == 0:
            argv += ["--rdzv_conf", "is_host=1"]
    return argv


@pytest.mark.parametrize("rendezvous, schedule", [("c10d", "GPipe"), ("static", "1F1B")])
def test_pipelining_transformer_one_stage_per_host(hosts, tmp_path, rendezvous, schedule):
    from pipelining_transformer.train import build_parser, check_args, run_worker

    argv = (*PIPELINE, "--schedule", schedule)
    results = distkit.launch(run_worker, _make_args(build_parser, check_args, *argv))
    (expected,) = [r["losses"] for r in results.values() if r["losses"] is not None]

    # under torchrun, WORLD_SIZE comes from torchrun; the script is given the same flags
    jobs = [(host, [*_torchrun_argv(rendezvous, node, hosts), "pipelining_transformer/train.py", *argv],
             PIPELINE_IFACES) for node, host in enumerate(hosts[:2])]
    runs = run_on_hosts(jobs, tmp_path)
    _assert_all_succeeded(runs)

    stage_of = [re.findall(r"\[rank (\d)\] stages \[(\d)\] of 2", run.output) for run in runs]
    assert sorted(s for found in stage_of for s in found) == [("0", "0"), ("1", "1")], _outputs(runs)
    if rendezvous == "static":  # --node_rank i runs rank i
        assert stage_of == [[("0", "0")], [("1", "1")]]
    # the host with the last stage logs the loss of every step (4 decimals: atol 1e-4)
    printed = [_printed(r"\[rank \d\] step \d+/\d+  loss ([\d.]+)", run.output) for run in runs]
    assert sorted(map(len, printed)) == [0, len(expected)], _outputs(runs)
    torch.testing.assert_close(max(printed, key=len), expected, rtol=0, atol=PRINTED_4,
                               msg=lambda m: f"{m}\n{_outputs(runs)}")

    # gloo binds to GLOO_SOCKET_IFNAME's address; torchrun's own store (the master port,
    # and with c10d also a port torchrun picks) is torchrun's business: see the docs
    if rendezvous == "static":
        for run in runs:
            _assert_bound_to_own_address(run, ignore_ports=(STATIC_PORT,))


# ------------------------- pipelining_transformer --dp_size 2: one pipeline replica per host

# the tiny model on 4 ranks: dp=2 x pp=2, 2 micro-batches of 2 rows per replica and step
# (a flag given twice: the last one counts)
DP_PIPELINE = (*PIPELINE, "--world_size", "4", "--dp_size", "2", "--n_microbatches", "2",
               "--schedule", "1F1B")


def test_pipelining_transformer_dp2_x_pp2_one_replica_per_host(hosts, tmp_path):
    from pipelining_transformer.train import build_parser, check_args, run_worker

    results = distkit.launch(run_worker, _make_args(build_parser, check_args, *DP_PIPELINE))
    (expected,) = [r["losses"] for r in results.values() if r["losses"] is not None]

    # docs/multi_host.md's command: --nproc_per_node 2 gives each host one whole replica;
    # the checkpoint directory is shared (the namespaces share this machine's files)
    ckpt, log = tmp_path / "ckpt", tmp_path / "losses.jsonl"
    argv = (*DP_PIPELINE, "--checkpoint_dir", str(ckpt), "--checkpoint_every", "2",
            "--loss_log", str(log))
    jobs = [(host, [*_torchrun_argv("static", node, hosts, port=DP_PORT, nproc=2),
                    "pipelining_transformer/train.py", *argv], PIPELINE_IFACES)
            for node, host in enumerate(hosts[:2])]
    runs = run_on_hosts(jobs, tmp_path)
    _assert_all_succeeded(runs)

    # host i runs replica i: ranks 2i (stage 0) and 2i + 1 (stage 1)
    for node, run in enumerate(runs):
        found = re.findall(r"\[rank (\d)\] stages \[(\d)\] of 2 \(1F1B, manual split, replica (\d) of 2\)",
                           run.output)
        assert sorted(found) == [(str(2 * node), "0", str(node)), (str(2 * node + 1), "1", str(node))], \
            _outputs(runs)
    # the first replica's last stage (rank 1, host 0) logs the batch's loss, averaged over
    # both replicas: the one-machine run's, every step
    printed = [_printed(r"\[rank \d\] step \d+/\d+  loss ([\d.]+)", run.output) for run in runs]
    assert len(printed[1]) == 0, _outputs(runs)
    torch.testing.assert_close(printed[0], expected, rtol=0, atol=PRINTED_4,
                               msg=lambda m: f"{m}\n{_outputs(runs)}")
    logged = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
    torch.testing.assert_close(logged, expected, **FLOAT32, msg=lambda m: f"{m}\n{_outputs(runs)}")
    for run in runs:
        _assert_bound_to_own_address(run, ignore_ports=(DP_PORT,))

    # the checkpoint both hosts wrote at step 2 is one complete checkpoint, each rank's file in it
    # (that a dp=2 x pp=2 checkpoint resumes in other layouts: tests/test_pipelining_dp.py)
    saved = checkpoint.step_dir(ckpt, 2)
    assert checkpoint.problem(saved) is None, checkpoint.problem(saved)
    assert sorted(p.name for p in saved.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]


# --------------------- pipelining_transformer restarted by torchrun on both hosts after a kill

# The kill comes after step 4's checkpoint is seen (polled every 0.25 s); 40 steps of ~60 ms
# leave it 2 s to come before the end. Default dropout (0.1): only the random state in the
# checkpoint makes the resumed steps equal.
ELASTIC_STEPS = 40
ELASTIC = (*TINY_MODEL, "--steps", str(ELASTIC_STEPS))


def _elastic_jobs(hosts: list[Host], port: int, max_restarts: int, *flags: str):
    """docs/multi_host.md's restart command on 2 hosts: c10d, a new store per restart."""
    env = {**PIPELINE_IFACES, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    return [(host, [*_torchrun_argv("c10d", node, hosts, port=port), "--max-restarts",
                    str(max_restarts), "pipelining_transformer/train.py", *ELASTIC, *flags], env)
            for node, host in enumerate(hosts[:2])]


def _kill_rank_0_once(marker: Path, killed: dict[str, int]) -> Callable[[list[int]], None]:
    """A ``watch`` for run_on_hosts: once ``marker`` exists, SIGKILL rank 0's worker, on
    whichever host the rendezvous put it (the rank that writes the markers and hosts the
    store), and note that host and the pid torchrun will report."""

    def watch(launchers: list[int]) -> None:
        if killed or not marker.exists():
            return
        for node, launcher in enumerate(launchers):
            if 0 in (workers := workers_by_rank(launcher)):
                # the pid torchrun reports: the last of NSpid's, the one in the host's namespace
                status = Path(f"/proc/{workers[0]}/status").read_text()
                (ns_pid,) = re.findall(r"^NSpid:.*\t(\d+)$", status, re.MULTILINE)
                os.kill(workers[0], signal.SIGKILL)
                killed.update(node=node, pid=int(ns_pid))
    return watch


def test_pipelining_transformer_sigkilled_worker_restarts_the_job_on_both_hosts(hosts, tmp_path):
    reference = tmp_path / "uninterrupted.jsonl"
    proc = run_cli("pipelining_transformer/train.py", *ELASTIC, "--world_size", "2",
                   "--loss_log", str(reference), timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    uninterrupted = dict(logged_losses(reference))

    ckpt, log = tmp_path / "ckpt", tmp_path / "losses.jsonl"
    jobs = _elastic_jobs(hosts, ELASTIC_PORT, 1, "--checkpoint_dir", str(ckpt),
                         "--checkpoint_every", "2", "--resume", "--loss_log", str(log))
    killed: dict[str, int] = {}
    marker = checkpoint.step_dir(ckpt, 4) / checkpoint.COMPLETE
    runs = run_on_hosts(jobs, tmp_path, watch=_kill_rank_0_once(marker, killed))
    _assert_all_succeeded(runs)
    assert killed, f"rank 0 was never killed:\n{_outputs(runs)}"
    # torchrun on the killed worker's host saw the kill, and restarted (--max-restarts 1)
    assert f"failed (exitcode: -9) local_rank: 0 (pid: {killed['pid']})" in runs[killed["node"]].output, \
        _outputs(runs)
    # both hosts' workers resumed from the same checkpoint, with their random state
    output = "".join(run.output for run in runs)
    resumed = resumed_steps(output)
    assert len(resumed) == 2 and len(set(resumed)) == 1 and resumed[0] >= 4, _outputs(runs)
    assert output.count("random state restored") == 2, _outputs(runs)
    assert_equals_uninterrupted(log, uninterrupted, resumed[0])
    # the store rank 0 hosts (torchrun hosts none here) listens on its host's address only;
    # torchrun's rendezvous store (ELASTIC_PORT) listens on every interface: torchrun's choice
    for run in runs:
        _assert_bound_to_own_address(run, ignore_ports=(ELASTIC_PORT,))


def test_pipelining_transformer_kill_with_no_restarts_left_fails_both_hosts(hosts, tmp_path):
    ckpt = tmp_path / "ckpt"
    # ELASTIC's --steps given again: the last one counts
    jobs = _elastic_jobs(hosts, USED_UP_PORT, 0, "--steps", "100000", "--checkpoint_dir",
                         str(ckpt), "--checkpoint_every", "2", "--resume")
    killed: dict[str, int] = {}
    marker = checkpoint.step_dir(ckpt, 2) / checkpoint.COMPLETE
    # within run_on_hosts' HOST_TIMEOUT, start-up included: no host waits for the other
    runs = run_on_hosts(jobs, tmp_path, watch=_kill_rank_0_once(marker, killed))
    assert killed, f"rank 0 was never killed:\n{_outputs(runs)}"
    assert all(run.returncode != 0 for run in runs), _outputs(runs)
    # the killed worker's torchrun reports it as the root cause
    output = runs[killed["node"]].output
    report = output[output.index("Root Cause (first observed failure)"):]
    assert f"exitcode  : -9 (pid: {killed['pid']})" in report, _outputs(runs)


# -------------------------------------------- hangs across hosts: a rank or a host goes away

# Three cases at once, each on a pair of hosts of its own (one launch of all, not three in
# turn: the suite's time). Each pair runs jobs as docs/multi_host.md starts them, the pair's
# first host with rank 0 and the job's store, its second with rank 1: the pipeline and
# rpc_rnn (rank 0 the parameter server, an idle RPC server; rank 1 the trainer) under
# torchrun's static rendezvous, and for a stopped rank also the pipeline under distkit's
# launcher (--ranks). A host whose only rank is stopped waits until it is resumed or killed
# (docs/failures.md): once the first host's side has ended, the test kills it, as its user would.
HANG = 5  # --hang_timeout
HANG_FLAGS = ("--hang_timeout", str(HANG), "--threads", "1")
PIPELINE_HANG = ("pipelining_transformer/train.py", *TINY_MODEL, "--steps", "100000")
RNN_HANG = ("rpc_rnn/main.py", "--epochs", "100000", "--batches", "2")
HANG_READY = {"pipelining_transformer": r"step 2/", "rpc_rnn": r"epoch 2\t"}  # rank 1, under way
HANG_PORTS = {"rank_stopped": 29460, "second_host_lost": 29470, "first_host_lost": 29480}
# s from the event to the last of its pair's processes ending (rank_stopped: of the first host's):
# --hang_timeout and the peers' wait for stacks, the store's bound (first_host_lost), plus a loaded machine
HANG_BOUND = 45


@dataclass(frozen=True)
class HangJob:
    case: str
    example: str
    launcher: str  # "torchrun" or "distkit"
    node: int  # 0: the pair's first host


def _hang_jobs(hosts: list[Host]) -> tuple[list[HangJob], list[tuple[Host, list[str], dict[str, str]]]]:
    """Every case's jobs, on its own pair of hosts."""
    found, commands = [], []
    for k, case in enumerate(HANG_PORTS):
        pair = hosts[2 * k:2 * k + 2]
        # the watchdog and the store are distkit's, one for every example: a lost host once
        # per case (on one machine: tests/test_hangs.py runs each kind of example)
        kinds = {"rank_stopped": [("pipelining_transformer", "torchrun"), ("rpc_rnn", "torchrun"),
                                  ("pipelining_transformer", "distkit")],
                 "second_host_lost": [("pipelining_transformer", "torchrun")],
                 "first_host_lost": [("rpc_rnn", "torchrun")]}[case]
        for i, (example, launcher) in enumerate(kinds):
            argv = PIPELINE_HANG if example == "pipelining_transformer" else RNN_HANG
            ifaces = PIPELINE_IFACES if example == "pipelining_transformer" else RPC_IFACES
            port = HANG_PORTS[case] + i
            for node, host in enumerate(pair):
                if launcher == "torchrun":
                    cmd = [*_torchrun_argv("static", node, pair, port=port), *argv]
                else:
                    cmd = [*argv, "--world_size", "2", "--ranks", str(node), "--master_addr",
                           pair[0].addr, "--master_port", str(port)]
                found.append(HangJob(case, example, launcher, node))
                commands.append((host, [*cmd, *HANG_FLAGS], ifaces))
    return found, commands


def _lose_host(host: Host) -> None:
    """The machine drops off the network, then loses power: its link is cut first, so no
    FIN or RST tells the other host; then every process in it is killed."""
    _ip("-n", host.ns, "link", "set", IFNAME, "down")
    for pid in subprocess.run(["ip", "netns", "pids", host.ns], capture_output=True,
                              text=True).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def _rank_1_worker(job: HangJob, launcher: int) -> int:

    if job.launcher == "torchrun":
        return workers_by_rank(launcher)[1]
    (worker,) = [p for p in children(launcher) if b"spawn_main" in cmdline(p)]  # --ranks 1
    return worker


@pytest.mark.timeout(600)
def test_a_hang_across_hosts_ends_the_job(hosts, tmp_path):
    """A rank on the second host SIGSTOPped, the second host lost, or the first lost (it
    holds the job's store, and so the watchdogs'): the ranks still running end within the
    bound and say why, and nothing is left running on either host."""
    jobs, commands = _hang_jobs(hosts)
    pair_of = {case: hosts[2 * k:2 * k + 2] for k, case in enumerate(HANG_PORTS)}
    start: dict[str, float] = {}
    took: dict[str, float] = {}
    stopped: list[int] = []  # the stopped ranks, killed once the first host's side has ended

    def watch(launchers: list[int]) -> None:
        for case in HANG_PORTS:
            mine = [(j, pid) for j, pid in zip(jobs, launchers) if j.case == case]
            if case not in start:
                if all(re.search(HANG_READY[j.example], (tmp_path / f"host{i}.log").read_text())
                       for i, j in enumerate(jobs) if j.case == case and j.node == 1):
                    start[case] = time.monotonic()
                    if case == "rank_stopped":
                        for j, pid in mine:
                            if j.node == 1:
                                stopped.append(_rank_1_worker(j, pid))
                                os.kill(stopped[-1], signal.SIGSTOP)
                    else:
                        _lose_host(pair_of[case][1 if case == "second_host_lost" else 0])
            elif case == "rank_stopped" and case not in took:
                if not any(Path(f"/proc/{pid}").exists() for j, pid in mine if j.node == 0):
                    took[case] = time.monotonic() - start[case]
                    for pid in stopped:  # yours to resume or kill
                        os.kill(pid, signal.SIGKILL)
            elif case not in took and not any(Path(f"/proc/{pid}").exists() for _, pid in mine):
                took[case] = time.monotonic() - start[case]  # run_on_hosts reaps them

    try:
        runs = run_on_hosts(commands, tmp_path, watch=watch)
    finally:
        for host in hosts:
            _ip("-n", host.ns, "link", "set", IFNAME, "up")  # the hosts of the tests after
    for case in start.keys() - took.keys():  # the last to end: run_on_hosts returned then
        took[case] = time.monotonic() - start[case]
    text = _outputs(runs)
    assert sorted(start) == sorted(HANG_PORTS), f"not all under way ({sorted(start)}):\n{text}"
    slow = {case: round(t) for case, t in took.items() if t >= HANG_BOUND}
    assert not slow, f"ended too late: {slow}:\n{text}"
    for job, run in zip(jobs, runs):
        assert run.returncode != 0, text
        assert not subprocess.run(["ip", "netns", "pids", run.host.ns], capture_output=True,
                                  text=True).stdout, f"left running on {run.host.ns}:\n{text}"
        out = run.output
        if job.case == "rank_stopped" and job.node == 0:
            # rank 0 names rank 1 and prints its own stacks
            assert re.search(r"rank 1 (did not answer|stopped answering)", out), text
            assert "[rank 0] stacks (every thread)" in out, text
        elif job.case == "rank_stopped":  # killed by the test, and its launcher says so
            assert "[rank 1] stacks" not in out, text
            assert ("exitcode  : -9" in out if job.launcher == "torchrun" else
                    "rank 1 died (signal SIGKILL)" in out), text
        elif job.case == "second_host_lost" and job.node == 0:
            assert re.search(r"rank 1 (did not answer|stopped answering)", out), text
        elif job.case == "first_host_lost" and job.node == 1:  # the store's host is lost
            assert "rank 1: the job's rendezvous store has not answered for" in out, text


# ------------------------------------------------------- one host's command, results kept

def _run_and_keep_results(argv: list[str]) -> int:
    """``python tests/test_multihost.py OUT.pt X/main.py FLAGS``: run ``X/main.py FLAGS``
    exactly as ``python X/main.py FLAGS`` does, and also save what its ``distkit.Job``
    collected on this machine (``{rank: result}`` for the ranks it ran) to OUT.pt."""
    out, script, *flags = argv

    class KeptJob(distkit.Job):
        def __exit__(self, *exc):
            try:
                return super().__exit__(*exc)
            finally:
                torch.save(self.results, out)

    distkit.Job = KeptJob  # main.py launches inside `with distkit.Job(args) as job`
    example = importlib.import_module(script.removesuffix(".py").replace("/", "."))
    return example.main(flags)


if __name__ == "__main__":
    sys.exit(_run_and_keep_results(sys.argv[1:]))
