"""Several machines without machines: network namespaces joined by a bridge stand in for hosts, and each
host runs torchrun's recipe of docs/multi_host.md, one torchrun a host.

Each "host" is a network namespace with one veth interface (``eth0``, 10.231.0.i/24) on a bridge that
lives in a namespace of its own (``conftest.network_hosts``); nothing is added to this machine's own
network. A host's torchrun runs under ``ip netns exec`` and in a PID namespace of its own: TensorPipe
copies tensors between processes that share a PID namespace with process_vm_readv (its CMA channel)
instead of sending them over TCP, which real machines cannot do. The interface is given in the
environment (``GLOO_SOCKET_IFNAME``, ``TP_SOCKET_IFNAME``), as the page tells a user to.

- Every example once over two or three hosts, under the static rendezvous or c10d: each rank on the host
  torchrun's numbering puts it, its output there, and what the ranks computed equal to a one-machine run
  of the same flags (each host's script is ``tests/test_multihost.py OUT X/main.py FLAGS``, which runs
  ``X/main.py``'s ``main`` and also saves what its ranks left for it: ``_run_and_keep_results`` below).
- pipelining_transformer/train.py with ``--dp_size 2``: one pipeline replica per host, one checkpoint.
- train.py's restarts (``--max-restarts``): a worker SIGKILLed or frozen restarts the job on both hosts,
  which goes on from the newest checkpoint with the losses of an uninterrupted run (the frozen case also
  proves the page's ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: without it the restarted ranks never meet);
  with no restarts left, both hosts fail.
- A hang across hosts and a lost host: a rank SIGSTOPped, the second host lost, the first (torchrun's
  store) lost: the ranks still running end within ``--hang_timeout`` and say why; nothing is left.

While the runs go, the listening sockets of every host are read from /proc: gloo and TensorPipe bind to
the interface the variables name, never to every interface (torchrun's own store does: its choice).

Root is needed to create namespaces; elsewhere these tests skip with the reason.
"""
from __future__ import annotations

import importlib
import ipaddress
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import distkit
from conftest import (FLOAT32, IFNAME, PRINTED_4, REPO, Host, assert_equals_uninterrupted, checked_args,
                      ip as _ip, logged_losses, network_hosts, resumed_steps, run_cli, workers_by_rank)
from pipelining_transformer import checkpoint

SUBNET = "10.231.0"
HOST_TIMEOUT = 240  # seconds for all hosts of one run, start-up included (slow, shared CPUs)
IFACES = {"GLOO_SOCKET_IFNAME": IFNAME, "TP_SOCKET_IFNAME": IFNAME}  # what the page has a user export


@dataclass
class HostRun:
    host: Host
    returncode: int
    output: str
    listening: set[tuple[str, int]]  # (address, port) of every listening TCP socket seen


@pytest.fixture(scope="module")
def hosts():
    """Six hosts on one bridge (up to three a run, and three pairs for the hang cases); torn down after
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


def _torchrun_argv(rendezvous: str, node: int, hosts: list[Host], port: int, nproc: int = 1,
                   max_restarts: int | None = None) -> list[str]:
    """docs/multi_host.md's torchrun command for machine ``node`` of ``hosts`` (after the interpreter:
    ``-m torch.distributed.run`` is ``.venv/bin/torchrun``)."""
    argv = ["-m", "torch.distributed.run", "--nnodes", str(len(hosts)), "--nproc_per_node", str(nproc)]
    if max_restarts is not None:
        argv += ["--max-restarts", str(max_restarts)]
    if rendezvous == "static":  # node_rank fixes which machine runs which ranks
        argv += ["--node_rank", str(node), "--master_addr", hosts[0].addr, "--master_port", str(port)]
    else:
        # the host names of these namespaces resolve to 127.0.0.1 (as on many Debian machines,
        # 127.0.1.1): say which machine hosts the rendezvous and what each machine's address is,
        # instead of letting torchrun guess from the host name
        argv += ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"{hosts[0].addr}:{port}",
                 "--local_addr", hosts[node].addr]
        if node == 0:
            argv += ["--rdzv_conf", "is_host=1"]
    return argv


def _printed(pattern: str, output: str) -> list[float]:
    return [float(x) for x in re.findall(pattern, output)]


# ------------------------------------------------------------------- every example, once over hosts

def _same_rpc_rl(got: dict, ref: dict) -> None:
    assert got[0]["rewards"] == ref[0]["rewards"]  # the same actions, so the same episodes
    for name, p in ref[0]["policy"].items():
        torch.testing.assert_close(got[0]["policy"][name], p, msg=lambda m: f"{name}: {m}")


def _same_rpc_rnn(got: dict, ref: dict) -> None:
    torch.testing.assert_close(got[1]["losses"], ref[1]["losses"], **FLOAT32)  # the trainer's


def _same_ddp_rpc(got: dict, ref: dict) -> None:
    out, expected = got[2], ref[2]  # the master's
    # the same losses, the same DDP-averaged fc on both trainers, the same table after both trainers' steps
    for report, want in zip(out["trainers"], expected["trainers"], strict=True):
        torch.testing.assert_close(report.losses, want.losses, **FLOAT32)
        for name, p in want.fc_after.items():
            torch.testing.assert_close(report.fc_before[name], want.fc_before[name])
            torch.testing.assert_close(report.fc_after[name], p)
    torch.testing.assert_close(out["emb_before"], expected["emb_before"])
    torch.testing.assert_close(out["emb_after"], expected["emb_after"])
    assert not torch.equal(out["emb_after"], out["emb_before"])


def _same_resnet(got: dict, ref: dict) -> None:
    """The master's (main.py) or the last stage's (pipelining.py) losses, for each --splits value."""
    rank = max(ref)  # main.py: 0 alone; pipelining.py: rank 1's runs have the losses
    assert [r["num_split"] for r in got[rank]] == [r["num_split"] for r in ref[rank]]
    for run, want in zip(got[rank], ref[rank]):
        assert len(want["losses"]) == 2  # the second after a step: the distributed backward's
        torch.testing.assert_close(run["losses"], want["losses"], **FLOAT32)


def _same_pipeline(got: dict, ref: dict) -> None:
    """The last stage's losses: main.py's list, train.py's run."""
    def losses(ranks: dict) -> list[float]:
        (found,) = [v if isinstance(v, list) else v["losses"] for v in ranks.values()
                    if (v if isinstance(v, list) else v["losses"])]
        return found

    assert len(losses(ref)) == 4
    torch.testing.assert_close(losses(got), losses(ref), **FLOAT32)


@dataclass(frozen=True)
class Recipe:
    """An example as docs/multi_host.md runs it: its script and flags (torchrun gives the world size), the
    processes of each host (``--nproc_per_node``), the rendezvous, and what must equal a one-machine run."""

    script: str
    flags: tuple[str, ...]
    nproc: tuple[int, ...]
    rendezvous: str
    same: Callable[[dict, dict], None]
    port: int  # a port a test: a closed store's may linger in TIME_WAIT

    @property
    def module(self) -> str:
        return self.script.removesuffix(".py").replace("/", ".")


# --threads 1 everywhere: a host's processes and the one-machine run then do the same arithmetic in the
# same order. Small runs, each with a step whose result crosses the hosts.
TINY_MODEL = ("--dim", "16", "--n_heads", "2", "--n_layers", "2", "--vocab_size", "32", "--seq_len", "8",
              "--batch_size", "8", "--n_microbatches", "4", "--seed", "3", "--threads", "1")
PIPELINE = (*TINY_MODEL, "--steps", "4", "--dropout", "0", "--optimizer", "sgd", "--lr", "0.1")
RESNET = ("--batch_size", "4", "--image_size", "32", "--num_batches", "2", "--num_classes", "10",
          "--splits", "2", "--threads", "1")
RECIPES = {
    # the agent on the first host, its observer on the second: one observer, so one run the seed fixes
    "rpc_rl": Recipe("rpc_rl/main.py", ("--reward_threshold", "3", "--max_episodes", "50", "--seed", "2",
                                        "--gamma", "0.95", "--threads", "1"), (1, 1), "static", _same_rpc_rl, 29400),
    # the parameter server and the trainer, each where the rendezvous puts it
    "rpc_rnn": Recipe("rpc_rnn/main.py", ("--epochs", "2", "--batches", "2", "--seed", "4", "--threads", "1"),
                      (1, 1), "c10d", _same_rpc_rnn, 29405),
    # trainer0 | trainer1 and the master | the parameter server: DDP's allreduce, the RPCs to the table
    # and the distributed backward all cross hosts. One iteration: from the second on, a trainer's
    # lookup may or may not see the other's last update (the tutorial's asynchronous design)
    "ddp_rpc": Recipe("ddp_rpc/main.py", ("--epochs", "1", "--batches_per_epoch", "1", "--batch_size", "8",
                                          "--seed", "2", "--lr", "0.5", "--threads", "1"), (1, 2, 1), "static",
                      _same_ddp_rpc, 29410),
    # the master and each shard on hosts of their own
    "rpc_pipeline_resnet": Recipe("rpc_pipeline_resnet/main.py", RESNET, (1, 1, 1), "c10d", _same_resnet, 29415),
    "rpc_pipeline_resnet.pipelining": Recipe("rpc_pipeline_resnet/pipelining.py", RESNET, (1, 1), "static",
                                             _same_resnet, 29420),
    # one stage per host, the tutorial's GPipe; train.py's under c10d and 1F1B
    "pipelining_transformer": Recipe("pipelining_transformer/main.py", PIPELINE, (1, 1), "static",
                                     _same_pipeline, 29425),
    "pipelining_transformer.train": Recipe("pipelining_transformer/train.py", (*PIPELINE, "--schedule", "1F1B"),
                                           (1, 1), "c10d", _same_pipeline, 29430),
}


def _kept(out: Path) -> dict[int, dict]:
    """{rank: what that rank's process kept} from ``_run_and_keep_results``'s files in ``out``."""
    return {int(p.stem.removeprefix("rank")): torch.load(p, weights_only=False) for p in out.glob("rank*.pt")}


@pytest.mark.parametrize("name", RECIPES)
def test_every_example_over_hosts_computes_what_one_machine_computes(name, hosts, tmp_path):
    recipe = RECIPES[name]
    world_size = sum(recipe.nproc)
    module = importlib.import_module(recipe.module)
    reference = distkit.launch(module.run_worker, checked_args(recipe.module, *recipe.flags,
                                                               "--world_size", str(world_size)))
    mine = hosts[:len(recipe.nproc)]
    jobs = [(host, [*_torchrun_argv(recipe.rendezvous, node, mine, recipe.port, nproc),
                    __file__, str(tmp_path / f"kept{node}"), recipe.script, *recipe.flags], IFACES)
            for node, (host, nproc) in enumerate(zip(mine, recipe.nproc))]
    runs = run_on_hosts(jobs, tmp_path)
    _assert_all_succeeded(runs)

    kept = [_kept(tmp_path / f"kept{node}") for node in range(len(mine))]
    ranks = [sorted(k) for k in kept]
    assert sorted(r for found in ranks for r in found) == list(range(world_size)), ranks
    assert [len(found) for found in ranks] == list(recipe.nproc), ranks  # --nproc_per_node a host
    if recipe.rendezvous == "static":  # torchrun numbers the ranks host by host, in --node_rank order
        assert [r for found in ranks for r in found] == list(range(world_size)), ranks
    for found, run in zip(ranks, runs):  # each rank's output on its own host
        printed = {int(r) for r in re.findall(r"^\[rank (\d+)\]", run.output, re.MULTILINE)}
        assert printed <= set(found), f"{run.host.ns} runs {found} and printed {printed}:\n{_outputs(runs)}"
    got = {rank: result for k in kept for rank_kept in k.values() for rank, result in rank_kept.items()}
    assert sorted(got) == sorted(reference), (sorted(got), sorted(reference))
    recipe.same(got, reference)

    # gloo and TensorPipe bind to the interface the variables name; torchrun's store (the master port,
    # and under c10d also a port it picks) listens on every interface: torchrun's choice, see the page
    if recipe.rendezvous == "static":
        for run in runs:
            assert run.listening, f"no listening socket seen on {run.host.ns}"
            _assert_bound_to_own_address(run, ignore_ports=(recipe.port,))


# ------------------------- pipelining_transformer --dp_size 2: one pipeline replica per host

# the tiny model on 4 ranks: dp=2 x pp=2, 2 micro-batches of 2 rows per replica and step
# (a flag given twice: the last one counts)
DP_PIPELINE = (*PIPELINE, "--dp_size", "2", "--n_microbatches", "2", "--schedule", "1F1B")
DP_PORT = 29440


def test_pipelining_transformer_dp2_x_pp2_one_replica_per_host(hosts, tmp_path):
    from pipelining_transformer.train import run_worker

    args = checked_args("pipelining_transformer.train", *DP_PIPELINE, "--world_size", "4")
    (expected,) = [r["losses"] for r in distkit.launch(run_worker, args).values() if r["losses"] is not None]

    # docs/multi_host.md's command: --nproc_per_node 2 gives each host one whole replica;
    # the checkpoint directory is shared (the namespaces share this machine's files)
    ckpt, log = tmp_path / "ckpt", tmp_path / "losses.jsonl"
    argv = (*DP_PIPELINE, "--checkpoint_dir", str(ckpt), "--checkpoint_every", "2", "--loss_log", str(log))
    jobs = [(host, [*_torchrun_argv("static", node, hosts[:2], DP_PORT, nproc=2),
                    "pipelining_transformer/train.py", *argv], IFACES)
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


# ------------- pipelining_transformer restarted by torchrun on both hosts: a worker killed or frozen

# The event comes after step 4's checkpoint is seen (polled every 0.25 s); 40 steps of ~60 ms
# leave it 2 s to come before the end. Default dropout (0.1): only the random state in the
# checkpoint makes the resumed steps equal.
ELASTIC_STEPS = 40
ELASTIC = (*TINY_MODEL, "--steps", str(ELASTIC_STEPS))
ELASTIC_PORTS = {"killed": 29450, "stopped": 29452}
USED_UP_PORT = 29455
RESTART_HANG = 10  # --hang_timeout of the frozen case: the frozen worker's peer ends at it


def _elastic_jobs(hosts: list[Host], port: int, max_restarts: int, *flags: str):
    """docs/multi_host.md's restart command on 2 hosts: c10d, a new store for every restart."""
    env = {**IFACES, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    return [(host, [*_torchrun_argv("c10d", node, hosts[:2], port, max_restarts=max_restarts),
                    "pipelining_transformer/train.py", *ELASTIC, *flags], env)
            for node, host in enumerate(hosts[:2])]


def _signal_rank_0_once(marker: Path, sig: signal.Signals, done: dict[str, int]) -> Callable[[list[int]], None]:
    """A ``watch`` for run_on_hosts: once ``marker`` exists, send ``sig`` to rank 0's worker, on
    whichever host the rendezvous put it (the rank that writes the markers), and note that
    host and the pid torchrun will report."""

    def watch(launchers: list[int]) -> None:
        if done or not marker.exists():
            return
        for node, launcher in enumerate(launchers):
            if 0 in (workers := workers_by_rank(launcher)):
                # the pid torchrun reports: the last of NSpid's, the one in the host's namespace
                status = Path(f"/proc/{workers[0]}/status").read_text()
                (ns_pid,) = re.findall(r"^NSpid:.*\t(\d+)$", status, re.MULTILINE)
                os.kill(workers[0], sig)
                done.update(node=node, pid=int(ns_pid))
    return watch


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, float]:
    """{step: loss} of ELASTIC's run on one machine, never stopped."""
    reference = tmp_path_factory.mktemp("uninterrupted") / "losses.jsonl"
    proc = run_cli("pipelining_transformer/train.py", *ELASTIC, "--world_size", "2",
                   "--loss_log", str(reference), timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return dict(logged_losses(reference))


@pytest.mark.parametrize("event", ["killed", "stopped"])
def test_pipelining_transformer_restarts_the_job_on_both_hosts(event, hosts, uninterrupted, tmp_path):
    """Rank 0's worker SIGKILLed, or SIGSTOPped: its peer on the other host ends at --hang_timeout, and
    that host's torchrun counts the restart, while the frozen worker's restarts it without counting (its
    worker was still alive), so the two hosts' TORCHELASTIC_RESTART_COUNT differ and no key prefix made
    from it could be shared: the page's variable gives each restart a new store. Either way both hosts'
    ranks resume from the same checkpoint and log the losses of an uninterrupted run."""
    ckpt, log = tmp_path / "ckpt", tmp_path / "losses.jsonl"
    flags = ("--checkpoint_dir", str(ckpt), "--checkpoint_every", "2", "--resume", "--loss_log", str(log))
    if event == "stopped":
        flags += ("--hang_timeout", str(RESTART_HANG))
    jobs = _elastic_jobs(hosts, ELASTIC_PORTS[event], 1, *flags)
    hit: dict[str, int] = {}
    marker = checkpoint.step_dir(ckpt, 4) / checkpoint.COMPLETE
    sig = signal.SIGKILL if event == "killed" else signal.SIGSTOP
    runs = run_on_hosts(jobs, tmp_path, watch=_signal_rank_0_once(marker, sig, hit))
    _assert_all_succeeded(runs)
    assert hit, f"rank 0 was never {event}:\n{_outputs(runs)}"
    if event == "killed":  # torchrun on the killed worker's host saw the kill, and restarted (--max-restarts 1)
        assert f"failed (exitcode: -9) local_rank: 0 (pid: {hit['pid']})" in runs[hit["node"]].output, \
            _outputs(runs)
    else:  # the peer of the frozen rank ended at its bound; the frozen rank's host restarted on that
        assert "[rank 1] no progress" in runs[1 - hit["node"]].output, _outputs(runs)
    # both hosts' workers resumed from the same checkpoint, with their random state
    output = "".join(run.output for run in runs)
    resumed = resumed_steps(output)
    assert len(resumed) == 2 and len(set(resumed)) == 1 and resumed[0] >= 4, _outputs(runs)
    assert output.count("random state restored") == 2, _outputs(runs)
    assert_equals_uninterrupted(log, uninterrupted, resumed[0])


def test_pipelining_transformer_kill_with_no_restarts_left_fails_both_hosts(hosts, tmp_path):
    ckpt = tmp_path / "ckpt"
    # ELASTIC's --steps given again: the last one counts
    jobs = _elastic_jobs(hosts, USED_UP_PORT, 0, "--steps", "100000", "--checkpoint_dir",
                         str(ckpt), "--checkpoint_every", "2", "--resume")
    killed: dict[str, int] = {}
    marker = checkpoint.step_dir(ckpt, 2) / checkpoint.COMPLETE
    # within run_on_hosts' HOST_TIMEOUT, start-up included: no host waits for the other
    runs = run_on_hosts(jobs, tmp_path, watch=_signal_rank_0_once(marker, signal.SIGKILL, killed))
    assert killed, f"rank 0 was never killed:\n{_outputs(runs)}"
    assert all(run.returncode != 0 for run in runs), _outputs(runs)
    # the killed worker's torchrun reports it as the root cause
    output = runs[killed["node"]].output
    report = output[output.index("Root Cause (first observed failure)"):]
    assert f"exitcode  : -9 (pid: {killed['pid']})" in report, _outputs(runs)


# -------------------------------------------- hangs across hosts: a rank or a host goes away

# Three cases at once, each on a pair of hosts of its own (one launch of all, not three in turn: the
# suite's time). Each pair runs jobs as docs/multi_host.md starts them (the static rendezvous), the
# pair's first host with rank 0 and torchrun's store, its second with rank 1: the pipeline, and
# rpc_rnn (rank 0 the parameter server, which only waits; rank 1 the trainer). A host whose only rank is
# stopped waits until it is resumed or killed (docs/failures.md): once the first host's side has ended,
# the test kills it, as its user would.
HANG = 5  # --hang_timeout
HANG_FLAGS = ("--hang_timeout", str(HANG), "--threads", "1")
PIPELINE_HANG = ("pipelining_transformer/train.py", *TINY_MODEL, "--steps", "100000")
RNN_HANG = ("rpc_rnn/main.py", "--epochs", "100000", "--batches", "2")
HANG_READY = {"pipelining_transformer": r"step 2/", "rpc_rnn": r"epoch 2\t"}  # rank 1, under way
# each case's examples: the hang bound is each rank's own, the same code in every example (on one
# machine, tests/test_hangs.py runs each kind); a lost host once per example kind
HANG_CASES = {"rank_stopped": ("pipelining_transformer", "rpc_rnn"), "second_host_lost": ("pipelining_transformer",),
              "first_host_lost": ("rpc_rnn",)}
HANG_PORTS = {"rank_stopped": 29460, "second_host_lost": 29470, "first_host_lost": 29480}
# s from the event to the last of its pair's processes ending (rank_stopped: of the first host's):
# --hang_timeout and the peers' wait for stacks, torchrun's ending of its workers, a loaded machine
HANG_BOUND = 45


@dataclass(frozen=True)
class HangJob:
    case: str
    example: str
    node: int  # 0: the pair's first host


def _hang_jobs(hosts: list[Host]) -> tuple[list[HangJob], list[tuple[Host, list[str], dict[str, str]]]]:
    """Every case's jobs, on its own pair of hosts."""
    found, commands = [], []
    for k, (case, examples) in enumerate(HANG_CASES.items()):
        pair = hosts[2 * k:2 * k + 2]
        for i, example in enumerate(examples):
            argv = PIPELINE_HANG if example == "pipelining_transformer" else RNN_HANG
            for node, host in enumerate(pair):
                found.append(HangJob(case, example, node))
                commands.append((host, [*_torchrun_argv("static", node, pair, HANG_PORTS[case] + i), *argv,
                                        *HANG_FLAGS], IFACES))
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


@pytest.mark.timeout(600)
def test_a_hang_across_hosts_ends_the_job(hosts, tmp_path):
    """A rank on the second host SIGSTOPped, the second host lost, or the first lost (it holds torchrun's
    store): the ranks still running end within the bound, each with its stacks and why (torchrun's
    summary names it), and nothing is left running on either host."""
    jobs, commands = _hang_jobs(hosts)
    pair_of = {case: hosts[2 * k:2 * k + 2] for k, case in enumerate(HANG_CASES)}
    start: dict[str, float] = {}
    took: dict[str, float] = {}
    stopped: list[int] = []  # the stopped ranks, killed once the first host's side has ended

    def watch(launchers: list[int]) -> None:
        for case in HANG_CASES:
            mine = [(j, pid) for j, pid in zip(jobs, launchers) if j.case == case]
            if case not in start:
                if all(re.search(HANG_READY[j.example], (tmp_path / f"host{i}.log").read_text())
                       for i, j in enumerate(jobs) if j.case == case and j.node == 1):
                    start[case] = time.monotonic()
                    if case == "rank_stopped":
                        for j, pid in mine:
                            if j.node == 1:
                                stopped.append(workers_by_rank(pid)[1])
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
    assert sorted(start) == sorted(HANG_CASES), f"not all under way ({sorted(start)}):\n{text}"
    slow = {case: round(t) for case, t in took.items() if t >= HANG_BOUND}
    assert not slow, f"ended too late: {slow}:\n{text}"
    for job, run in zip(jobs, runs):
        assert run.returncode != 0, text
        assert not subprocess.run(["ip", "netns", "pids", run.host.ns], capture_output=True,
                                  text=True).stdout, f"left running on {run.host.ns}:\n{text}"
        out = run.output
        survivor = {"rank_stopped": 0, "second_host_lost": 0, "first_host_lost": 1}[job.case]
        if job.node == survivor:
            # the rank still running says why it ends, prints its stacks, and torchrun's summary names it
            rank = survivor
            assert f"[rank {rank}] no progress" in out and f"over --hang_timeout {HANG:g}: a hang" in out, text
            assert "most recent call first" in out, text
            report = out[out.index("Root Cause (first observed failure)"):]
            assert f"rank      : {rank} (local_rank: 0)" in report and "TimeoutError" in report, text
        elif job.case == "rank_stopped":  # killed by the test, and its torchrun says so
            assert "exitcode  : -9" in out, text


# ------------------------------------------------------- one host's command, results kept

def _run_and_keep_results(argv: list[str]) -> int:
    """``tests/test_multihost.py OUT X/main.py FLAGS``, torchrun's script in place of ``X/main.py FLAGS``:
    runs ``X/main.py``'s ``main(FLAGS)`` as ``python X/main.py FLAGS`` does, and also saves what this
    rank left for it (``distkit.save_result``: ``{rank: result}``, read by ``distkit.results``) to
    ``OUT/rank<RANK>.pt``, an empty dict where it left none."""
    out, script, *flags = argv
    kept: dict = {}
    read = distkit.results

    def results() -> dict:
        found = read()
        kept.update(found)
        return found

    distkit.results = results  # what main() reads after its rank's run_worker
    example = importlib.import_module(script.removesuffix(".py").replace("/", "."))
    status = example.main(flags)
    kept.update(read())  # what main() did not read
    os.makedirs(out, exist_ok=True)
    torch.save(kept, os.path.join(out, f"rank{os.environ['RANK']}.pt"))
    return status


if __name__ == "__main__":
    sys.exit(_run_and_keep_results(sys.argv[1:]))
