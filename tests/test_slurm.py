"""Under SLURM every example runs as PyTorch launches across nodes: one torchrun per node (``srun
torchrun``, scripts/slurm/train.sbatch), and ``srun -n N python X/main.py`` (N > 1) is refused with the
command that works (tests/test_distkit.py, in-process). On a real SLURM: a two-node cluster (munged,
slurmctld, a slurmd on each node, each node a network namespace with its own address, host name and PID
namespace) this module starts in a directory of its own, where SLURM is installed (``.ci/run`` installs it
as root: ``apt-get install slurm-wlm munge``); elsewhere those tests skip with the reason.
"""
from __future__ import annotations

import functools
import getpass
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import (IFNAME, PRINTED_4, REPO, alive, assert_all_gone, assert_equals_uninterrupted, logged_losses,
                      network_hosts, resumed_steps, run_cli)


# ----------------------------------------------------------- a real SLURM, two nodes

@dataclass(frozen=True)
class Cluster:
    """A two-node SLURM: ``login`` prefixes a command run on node1 (where slurmctld is), ``env`` its
    environment (``SLURM_CONF``, and every library's interface: the nodes' ``eth0``)."""

    env: dict[str, str]
    login: list[str]

    def run(self, *argv: str, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run([*self.login, *argv], cwd=REPO, env=self.env, capture_output=True, text=True,
                              **kwargs)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A cluster of two nodes this module starts and stops: munged, then slurmctld on node1 and a slurmd
    on each node, each node a network namespace of ``conftest.network_hosts`` (its own address, host
    name, PID namespace; /etc/hosts naming both nodes). Skips without SLURM or root."""
    missing = [d for d in ("munged", "slurmctld", "slurmd", "srun") if not shutil.which(d)
               and not Path("/usr/sbin", d).exists()]
    if missing or os.geteuid() != 0:
        pytest.skip(f"needs SLURM and root ({'missing ' + ', '.join(missing) if missing else 'not root'}): "
                    f"as root, apt-get install slurm-wlm munge (.ci/run does)")
    d = tmp_path_factory.mktemp("slurm")
    with network_hosts(f"sl{os.getpid()}", 2, "10.232.0") as nodes:
        names = [f"node{i}" for i in (1, 2)]
        (d / "hosts").write_text("127.0.0.1 localhost\n" + "".join(f"{n.addr} {name}\n" for n, name in zip(nodes, names)))
        for name in names:
            (d / f"spool-{name}").mkdir()
        conf = d / "slurm.conf"
        conf.write_text(f"""ClusterName=distkit-test
SlurmctldHost={names[0]}({nodes[0].addr})
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}
SlurmdSpoolDir={d}/spool-%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmdParameters=config_overrides
""" + "".join(f"NodeName={name} NodeAddr={n.addr} CPUs=4 RealMemory=4000 State=UNKNOWN\n"
              for n, name in zip(nodes, names)) +
            "PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE\n")
        # CPUs=4 a node on any machine (config_overrides): two 2-rank tasks fit each
        env = {**os.environ, "SLURM_CONF": str(conf), "PYTHONUNBUFFERED": "1", "IFNAME": IFNAME,  # train.sbatch's
               "GLOO_SOCKET_IFNAME": IFNAME, "TP_SOCKET_IFNAME": IFNAME}  # a bare srun's
        daemons = []
        if subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode:  # none running
            Path("/run/munge").mkdir(exist_ok=True)
            shutil.chown("/run/munge", "munge", "munge")
            daemons.append(subprocess.Popen(["su", "-s", "/bin/sh", "munge", "-c", "exec /usr/sbin/munged -F"],
                                            start_new_session=True))
            while subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode:
                time.sleep(0.2)
        for i, (node, name) in enumerate(zip(nodes, names)):
            # on the node's network, under its name; a slurmd in a PID namespace with its own /proc, as
            # on a machine of its own (SLURM's proctrack finds the tasks it starts there)
            for daemon in (["slurmctld"] if i == 0 else []) + ["slurmd"]:
                flags = "--mount --uts" + (" --pid --fork --kill-child --mount-proc" if daemon == "slurmd" else "")
                daemons.append(subprocess.Popen(
                    ["nsenter", f"--net=/run/netns/{node.ns}", "unshare", *flags.split(), "sh", "-c",
                     f"mount --bind {d}/hosts /etc/hosts && hostname {name} && exec /usr/sbin/{daemon} -D -f {conf}"
                     + (f" -N {name}" if daemon == "slurmd" else "")],
                    env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        cluster = Cluster(env, ["nsenter", f"--net=/run/netns/{nodes[0].ns}"])
        try:
            deadline = time.monotonic() + 60
            while cluster.run("sinfo", "-h", "-o", "%T %D").stdout.split() != ["idle", "2"]:
                if time.monotonic() > deadline:
                    pytest.fail(f"the test cluster did not come up:\n{(d / 'slurmctld.log').read_text()[-2000:]}")
                time.sleep(0.5)
            yield cluster
        finally:
            cluster.run("scancel", "--user", getpass.getuser())
            for p in daemons:  # the whole session: `unshare --fork` ignores SIGTERM while its child runs
                os.killpg(p.pid, signal.SIGTERM)
            for p in daemons:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()


def _sbatch(slurm: Cluster, log: Path, *argv: str, how: tuple[str, ...] = ("--ntasks-per-node", "1"),
            timeout: float = 240) -> subprocess.CompletedProcess:
    """``sbatch --wait -N 2 HOW scripts/slurm/train.sbatch argv``, its output in ``log``."""
    return slurm.run("sbatch", "--wait", "-N", "2", *how, "-o", str(log), "--export",
                     f"ALL,PYTHON={sys.executable},PYTHONUNBUFFERED=1", "scripts/slurm/train.sbatch", *argv,
                     timeout=timeout)


def test_srun_of_several_plain_tasks_is_refused_with_the_command_that_works(slurm):
    """``srun -N 2 -n 2 python rpc_rl/main.py``: before, each task ran a job of its own; now each says,
    in one line, to start one torchrun per node."""
    proc = slurm.run("srun", "-N", "2", "-n", "2", sys.executable, "rpc_rl/main.py", timeout=120)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "srun --ntasks-per-node 1 .venv/bin/torchrun" in proc.stderr, proc.stderr
    assert "[rank" not in proc.stdout, proc.stdout  # nothing was spawned


def test_srun_torchrun_runs_one_job_over_the_nodes(slurm, tmp_path):
    """Three ranks of rpc_rl would not spread evenly over two nodes: refused by the sbatch script; four do,
    two a node: one job (one agent, one "Solved!")."""
    log = tmp_path / "uneven.out"
    proc = _sbatch(slurm, log, "rpc_rl/main.py", how=("-n", "3"))
    assert proc.returncode != 0 and "do not spread evenly over 2 nodes" in log.read_text(), log.read_text()
    log = tmp_path / "job.out"
    proc = _sbatch(slurm, log, "rpc_rl/main.py", "--reward_threshold", "0.5", "--max_episodes", "5",
                   how=("--ntasks-per-node", "2"))
    out = log.read_text() if log.exists() else ""
    assert proc.returncode == 0, proc.stdout + proc.stderr + out
    assert out.count("Solved!") == 1, out


RNN_LOSS, PIPELINE_LOSS = r"Training epoch \d+\tloss ([0-9.]+)", r"step \d+/\d+  loss ([0-9.]+)"
RNN, PIPELINE = ("rpc_rnn/main.py", "--epochs", "3"), ("pipelining_transformer/main.py", "--steps", "3")
# scripts/slurm/train.sbatch over the two nodes (a torchrun a node), the example's command line, the
# one-machine run's flags beside it, its losses
AS_ON_ONE_MACHINE = [(RNN, (), RNN_LOSS), (PIPELINE, ("--world_size", "2"), PIPELINE_LOSS)]


@functools.cache
def _one_machine(argv: tuple[str, ...]) -> str:
    proc = run_cli(*argv, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.parametrize("argv, here, pattern", AS_ON_ONE_MACHINE, ids=[a[0].split("/")[0] for a, _, _ in AS_ON_ONE_MACHINE])
def test_slurm_trains_what_one_machine_trains(argv, here, pattern, slurm, tmp_path):
    """Through scripts/slurm/train.sbatch (srun torchrun), the losses the one-machine run prints."""
    log = tmp_path / "job.out"
    proc = _sbatch(slurm, log, *argv)
    out = log.read_text() if log.exists() else ""
    assert proc.returncode == 0, proc.stdout + proc.stderr + out
    losses = [[float(x) for x in re.findall(pattern, text)] for text in (out, _one_machine((*argv, *here)))]
    assert len(losses[0]) == len(losses[1]) == 3, (losses, out)
    assert losses[0] == pytest.approx(losses[1], abs=PRINTED_4)


# ------------------------------------------------- a requeued job resumes where SIGTERM stopped it

PREEMPTED = ("--dim", "64", "--n_heads", "2", "--n_layers", "2", "--vocab_size", "64", "--seq_len", "16",
             "--dropout", "0", "--seed", "4", "--threads", "1", "--steps", "60")


def _squeue_state(slurm: Cluster, job: str) -> str:
    return slurm.run("squeue", "-h", "-j", job, "-o", "%T").stdout.strip()


def test_a_requeued_job_resumes_exactly_where_sigterm_stopped_it(slurm, tmp_path):
    """``scontrol requeue`` (as preemption does) sends SIGTERM: every rank finishes its step, saves
    it and exits; the requeued job's ``--resume`` goes on from there, and every logged loss is the
    uninterrupted run's."""
    reference = tmp_path / "uninterrupted.jsonl"
    proc = run_cli("pipelining_transformer/train.py", *PREEMPTED, "--world_size", "2", "--loss_log",
                   str(reference), timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    log, out = tmp_path / "losses.jsonl", tmp_path / "job.out"
    job = slurm.run(
        "sbatch", "--parsable", "--requeue", "--open-mode=append", "-N", "2", "--ntasks-per-node", "1",
        "-o", str(out), "--export", f"ALL,PYTHON={sys.executable},PYTHONUNBUFFERED=1", "scripts/slurm/train.sbatch",
        "pipelining_transformer/train.py", *PREEMPTED, "--checkpoint_dir", str(tmp_path / "ckpt"), "--resume",
        "--loss_log", str(log), check=True).stdout.strip()
    try:
        deadline = time.monotonic() + 200
        while not (log.exists() and len(log.read_text().splitlines()) >= 5):
            assert time.monotonic() < deadline, out.read_text() if out.exists() else "no output"
            time.sleep(0.1)
        slurm.run("scontrol", "requeue", job, check=True)
        while (state := _squeue_state(slurm, job)) not in ("", "COMPLETED", "FAILED"):
            assert time.monotonic() < deadline, f"{state}:\n{out.read_text()}"
            if state == "PENDING":  # a requeued job waits its BeginTime (2 minutes): now
                slurm.run("scontrol", "update", f"JobId={job}", "StartTime=now")
            time.sleep(0.5)
    finally:
        slurm.run("scancel", job)
    text = out.read_text()
    assert _squeue_state(slurm, job) in ("", "COMPLETED"), text
    stopped = [int(s) for s in re.findall(r"stopped by SIGTERM after step (\d+)", text)]
    assert len(stopped) == 2 and len(set(stopped)) == 1, text  # both ranks, after the same step
    assert resumed_steps(text) == [stopped[0]] * 2, text
    assert_equals_uninterrupted(log, dict(logged_losses(reference)), stopped[0])


# ------------------------------------------------------------- a task lost, a job cancelled, a hang

def _ranks(mark: str) -> dict[int, int]:
    """{rank: pid} of the running workers whose environment holds ``mark`` (the test's own): the
    processes torchrun started, with RANK in their environment (its agents have none)."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            env = dict(e.split(b"=", 1) for e in (proc / "environ").read_bytes().split(b"\0") if b"=" in e)
        except (OSError, ValueError):
            continue
        if env.get(b"DISTKIT_TEST_MARK") == mark.encode() and b"RANK" in env and alive(int(proc.name)):
            found[int(env[b"RANK"])] = int(proc.name)  # /proc shows the environment at exec
    return found


TORCHRUN_GRACE = 30  # torchrun's agent gives its other workers 30 s to take SIGTERM


@pytest.mark.parametrize("event", ["rank 1 killed", "rank 1 stopped", "scancel"])
def test_a_lost_or_frozen_rank_or_scancel_ends_the_whole_job(event, slurm, tmp_path):
    """rpc_rnn through scripts/slurm/train.sbatch (a torchrun a node, srun --kill-on-bad-exit=1): rank 1
    SIGKILLed (its torchrun fails, srun ends the other node's), or SIGSTOPped (rank 0, the parameter
    server, whose pings it no longer answers, ends at --hang_timeout; rank 0's node fails, srun ends the
    other node's torchrun, and with it the stopped rank), or the job cancelled. Then nothing of the job
    is left running on either node."""
    mark, out = tmp_path.name, tmp_path / "out.txt"
    sbatch = subprocess.Popen(
        [*slurm.login, "sbatch", "--wait", "-N", "2", "--ntasks-per-node", "1", "-o", str(out), "--export",
         f"ALL,PYTHON={sys.executable},PYTHONUNBUFFERED=1,DISTKIT_TEST_MARK={mark}", "scripts/slurm/train.sbatch",
         "rpc_rnn/main.py", "--epochs", "100000", "--hang_timeout", "5", "--threads", "1"], cwd=REPO,
        env=slurm.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while (not out.exists() or "Training epoch 2\t" not in out.read_text()) or len(ranks := _ranks(mark)) < 2:
            assert time.monotonic() < deadline and sbatch.poll() is None, out.read_text() if out.exists() else ""
            time.sleep(0.2)
        if event == "scancel":
            job = Path(f"/proc/{ranks[0]}/environ").read_bytes().split(b"SLURM_JOB_ID=")[1].split(b"\0")[0]
            slurm.run("scancel", job.decode(), check=True)
        else:
            os.kill(ranks[1], signal.SIGKILL if event == "rank 1 killed" else signal.SIGSTOP)
        start = time.monotonic()
        sbatch.wait(timeout=120)
        took = time.monotonic() - start
    finally:
        sbatch.kill()
    text = out.read_text()
    assert sbatch.returncode != 0, text
    # --hang_timeout, torchrun's grace for its other workers, and then some on a loaded machine
    assert took < 5 + TORCHRUN_GRACE + 20, text
    if event == "rank 1 stopped":  # only rank 0 can see it: its hang bound ends it, with its stacks
        assert "[rank 0] no progress" in text and "over --hang_timeout 5: a hang" in text, text
        assert "most recent call first" in text, text
    assert_all_gone(list(ranks.values()), within=10)
