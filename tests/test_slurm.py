"""Under SLURM (issue 34): ``srun -n N python X/main.py`` is one job of N ranks, each task one rank
(``distkit.rendezvous.adopt_srun_task``), not N whole jobs. On a real SLURM: a two-node cluster
(munged, slurmctld, a slurmd on each node, each node a network namespace with its own address, host
name and PID namespace) this module starts in a directory of its own, where SLURM is installed
(``.ci/run`` installs it as root: ``apt-get install slurm-wlm munge``); elsewhere those tests skip
with the reason. The environment's reading is also checked in-process, with SLURM's variables.
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

from conftest import (IFNAME, PRINTED_4, REPO, alive, assert_all_gone, assert_equals_uninterrupted, checked_args,
                      logged_losses, network_hosts, refused_before_launch, resumed_steps, run_cli)

# what srun gives task 2 of 3, the only task on the second of two nodes
SRUN_TASK_2 = {"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "3", "SLURM_PROCID": "2", "SLURM_LOCALID": "0",
               "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "2,1", "SLURM_STEP_NODELIST": "gpu[07-08]",
               "SLURM_JOB_ID": "123456", "SLURM_NTASKS": "3"}


@pytest.fixture
def srun_env(monkeypatch):
    """``os.environ`` as a copy without torchrun's variables (restored after the test), SLURM's set."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    monkeypatch.setattr(os, "environ", env)
    return env


def test_an_srun_task_is_one_rank_of_the_step(srun_env):
    srun_env.update(SRUN_TASK_2)
    args = checked_args("rpc_rl.main")
    assert args.world_size == 3
    assert {k: srun_env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                     "MASTER_PORT")} == {
        "RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "gpu07",
        "MASTER_PORT": str(10000 + 123456 % 10000)}


def test_the_rendezvous_flags_win_over_slurms_environment(srun_env):
    srun_env.update(SRUN_TASK_2, SLURM_PROCID="0", SLURM_NODEID="0")
    checked_args("rpc_rl.main", "--master_addr", "10.0.0.7", "--master_port", "29999")
    assert (srun_env["RANK"], srun_env["LOCAL_WORLD_SIZE"], srun_env["MASTER_ADDR"], srun_env["MASTER_PORT"]) == (
        "0", "2", "10.0.0.7", "29999")


def test_an_sbatch_scripts_own_shell_is_not_a_rank(srun_env):
    """The batch script's shell has SLURM_NTASKS and SLURM_PROCID too, but no step: a plain
    ``python X/main.py`` there spawns its ranks itself."""
    srun_env.update({k: v for k, v in SRUN_TASK_2.items() if not k.startswith("SLURM_STEP")})
    args = checked_args("rpc_rl.main", "--world_size", "3")
    assert args.world_size == 3 and "RANK" not in srun_env


@pytest.mark.parametrize("argv, message", [
    (["--world_size", "4"], "--world_size 4 disagrees with srun's 3 tasks"),
    (["--ranks", "1"], "--ranks 1: under srun each task is one rank (SLURM_PROCID)"),
])
def test_flags_that_disagree_with_srun_are_refused(argv, message, srun_env, capsys, monkeypatch):
    from rpc_rl.main import main

    srun_env.update(SRUN_TASK_2)
    assert message in refused_before_launch(main, argv, capsys, monkeypatch)


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


def _srun(slurm: Cluster, ntasks: int, *argv: str) -> subprocess.CompletedProcess:
    """``srun -N 2 -n ntasks python argv`` from node1: the tasks spread over both nodes."""
    return slurm.run("srun", "-N", "2", "-n", str(ntasks), "--kill-on-bad-exit=1", sys.executable, *argv,
                     timeout=240)


def test_srun_runs_one_job_of_its_tasks(slurm):
    """The issue's case: three tasks of rpc_rl over two nodes, one job (one agent, one "Solved!"), not three."""
    proc = _srun(slurm, 3, "rpc_rl/main.py", "--reward_threshold", "0.5", "--max_episodes", "5")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("Solved!") == 1, proc.stdout


RNN_LOSS, PIPELINE_LOSS = r"Training epoch \d+\tloss ([0-9.]+)", r"step \d+/\d+  loss ([0-9.]+)"
RNN, PIPELINE = ("rpc_rnn/main.py", "--epochs", "3"), ("pipelining_transformer/main.py", "--steps", "3")
# how SLURM starts it over the two nodes, the example's command line, the one-machine run's flags beside
# it, its losses
AS_ON_ONE_MACHINE = [
    (["srun", "-n", "2"], RNN, (), RNN_LOSS),  # a rank a node
    (["sbatch", "-n", "2"], RNN, (), RNN_LOSS),  # scripts/slurm/train.sbatch: srun, a task per rank
    (["sbatch", "--ntasks-per-node", "1"], PIPELINE, ("--world_size", "2"), PIPELINE_LOSS),  # torchrun a node
]


@functools.cache
def _one_machine(argv: tuple[str, ...]) -> str:
    proc = run_cli(*argv, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.parametrize("how, argv, here, pattern", AS_ON_ONE_MACHINE,
                         ids=[f"{how[0]} {argv[0].split('/')[0]}" for how, argv, _, _ in AS_ON_ONE_MACHINE])
def test_slurm_trains_what_one_machine_trains(how, argv, here, pattern, slurm, tmp_path):
    """Under srun, and through scripts/slurm/train.sbatch, the losses the one-machine run prints."""
    if how[0] == "srun":
        proc = _srun(slurm, int(how[2]), *argv)
        out = proc.stdout
    else:
        log = tmp_path / "job.out"
        proc = slurm.run("sbatch", "--wait", "-N", "2", *how[1:], "-o", str(log), "--export",
                         f"ALL,PYTHON={sys.executable},PYTHONUNBUFFERED=1", "scripts/slurm/train.sbatch", *argv,
                         timeout=240)
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

def _tasks(mark: str) -> dict[int, int]:
    """{rank: pid} of the running processes whose environment holds ``mark`` (the test's own)."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            env = dict(e.split(b"=", 1) for e in (proc / "environ").read_bytes().split(b"\0") if b"=" in e)
        except (OSError, ValueError):
            continue
        if env.get(b"DISTKIT_TEST_MARK") == mark.encode() and b"SLURM_PROCID" in env and alive(int(proc.name)):
            found[int(env[b"SLURM_PROCID"])] = int(proc.name)  # /proc shows the environment at exec
    return found


@pytest.mark.parametrize("event", ["rank 1 killed", "rank 1 stopped", "scancel"])
def test_a_lost_or_frozen_task_or_scancel_ends_the_whole_step(event, slurm, tmp_path):
    """rpc_rnn under ``srun -N 2 -n 2 --kill-on-bad-exit=1`` (as scripts/slurm/train.sbatch starts it):
    rank 1, on the second node, SIGKILLed (srun reports it and ends rank 0 on the first), or SIGSTOPped
    (rank 0's watchdog names it within --hang_timeout, and srun ends the frozen task), or the job
    cancelled. Then nothing of the job is left running on either node."""
    mark, out = tmp_path.name, tmp_path / "out.txt"
    with out.open("w") as f:
        srun = subprocess.Popen(
            [*slurm.login, "srun", "-N", "2", "-n", "2", "--kill-on-bad-exit=1", sys.executable, "rpc_rnn/main.py",
             "--epochs", "100000", "--hang_timeout", "5", "--threads", "1"], cwd=REPO,
            env={**slurm.env, "PYTHONUNBUFFERED": "1", "DISTKIT_TEST_MARK": mark}, stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while "Training epoch 2\t" not in out.read_text() or len(tasks := _tasks(mark)) < 2:
            assert time.monotonic() < deadline and srun.poll() is None, out.read_text()
            time.sleep(0.2)
        if event == "scancel":
            job = Path(f"/proc/{tasks[0]}/environ").read_bytes().split(b"SLURM_JOB_ID=")[1].split(b"\0")[0]
            slurm.run("scancel", job.decode(), check=True)
        else:
            os.kill(tasks[1], signal.SIGKILL if event == "rank 1 killed" else signal.SIGSTOP)
        start = time.monotonic()
        srun.wait(timeout=60)
        took = time.monotonic() - start
    finally:
        srun.kill()
    text = out.read_text()
    assert srun.returncode != 0, text
    assert took < 5 + 20, text  # --hang_timeout, and then some on a loaded machine
    if event == "rank 1 killed":  # srun names the task and ends the others at once
        assert "task 1: Killed" in text, text
    elif event == "rank 1 stopped":  # only rank 0's watchdog can see it; srun then ends rank 1
        assert re.search(r"rank 1 (did not answer|stopped answering)", text), text
    assert_all_gone(list(tasks.values()), within=10)
