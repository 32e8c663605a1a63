"""Shared test helpers: every test runs real processes on the CPU with gloo."""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:  # not at run time: no torch before pytest_configure
    import torch

REPO = Path(__file__).resolve().parents[1]
# the sections of every example README that tests/test_tutorial_maps.py reads
HEADING = "## Where each tutorial step is"
DIFFERS = "## What differs from the tutorial, and why"


def gpu_tier(config: pytest.Config) -> bool:
    return bool(re.search(r"(?<!not )\bcuda\b", config.getoption("markexpr") or ""))


def pytest_configure(config: pytest.Config) -> None:
    # The CPU suite must behave the same on a GPU machine: it hides the GPUs (from this
    # process and every one it starts). The GPU tier, selected with `-m cuda`, sees them.
    if not gpu_tier(config):
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")


# The longest files first (--durations=0, session 15: test time in s), so that the two xdist workers
# (--dist loadfile: a file to one worker) do not end with one of them still in a long file alone.
# Not slurm and multihost first: started together, on the two workers, their many processes made a
# 5 s --hang_timeout fire in a first training step; so multihost goes to whichever ends first of slurm
# and faults, which take about as long
LONGEST_FIRST = ["test_slurm.py", "test_faults.py", "test_multihost.py", "test_quiet_output.py",
                 "test_hangs.py", "test_generated.py"]  # each a few minutes of processes (its re-run blocks)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its order


def checked_args(example: str, *argv: str) -> argparse.Namespace:
    """``argv`` as ``example``'s own ``build_parser`` and ``check_args`` leave it (``example``:
    a module, "rpc_rl.main"), the namespace a run gets. Each test file's ``make_args``."""
    module = importlib.import_module(example)  # here, not above: no torch before pytest_configure
    parser = module.build_parser()
    args = parser.parse_args(list(argv))
    module.check_args(parser, args)
    return args


def run_cli(*argv: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``python <argv>`` from the repository root, as a user would; capture its output."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=full_env)


def run_torchrun(nproc: int, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Launch ``argv`` with ``torchrun --standalone``, one rank per process."""
    return run_cli("-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                   *argv, timeout=timeout)


@pytest.fixture
def cli():
    return run_cli


def refused_before_launch(main, argv: list[str], capsys, monkeypatch) -> str:
    """``main(argv)`` exits with status 2 and one line on stderr before it launches anything
    (in this process: a process per case would cost seconds each); returns that line."""
    # imported here: conftest must not import torch before pytest_configure hides the GPUs
    import distkit

    import torch.multiprocessing

    # were a check to let bad input through, the test fails here instead of training
    def launched(*args, **kwargs):
        pytest.fail("launched despite bad input")

    monkeypatch.setattr(distkit, "prepare_spawn", launched)
    monkeypatch.setattr(torch.multiprocessing, "spawn", launched)
    monkeypatch.setattr(distkit, "start_rank", launched)
    monkeypatch.setattr(distkit, "launch", launched)  # the benchmarks' and make_pictures.py's launcher
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert err.count("\n") == 1, err
    return err


@pytest.fixture(autouse=True)
def signal_handling_restored() -> Iterator[None]:
    """An example's ``main()`` run in this process leaves distkit's Ctrl+C and SIGTERM handling behind
    (``distkit.prepare_spawn``: its handlers, SIGINT held back in this thread, Python's wakeup fd): the
    next test, and every process it starts (a held signal is inherited), gets pytest's back."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    wakeup = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(wakeup)
    yield
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    signal.set_wakeup_fd(wakeup)


@pytest.fixture
def kept_results(monkeypatch) -> Iterator[list[dict]]:
    """What ``distkit.results()`` returns to an example's ``main()`` in this test, each call's
    ``{rank: result}`` in order: the user's command in this process (its ``mp.spawn``), and the
    numbers underneath what it printed."""
    import distkit  # not at import: no torch before pytest_configure

    kept: list[dict] = []
    read = distkit.results

    def results() -> dict:
        kept.append(read())
        return kept[-1]

    monkeypatch.setattr(distkit, "results", results)
    environ = dict(os.environ)
    yield kept
    # main()'s distkit.prepare_spawn set the launcher's environment here (MASTER_PORT, DISTKIT_RESULTS):
    # left, it reached the ranks of a later test's torchrun, which then shared one results folder
    os.environ.clear()
    os.environ.update(environ)


# The examples as the fault and hang tests start them (tests/test_faults.py, test_hangs.py),
# and a job: a CLI run in its own process group, its processes found through /proc.
TINY_GPT = ("--dim", "32", "--n_layers", "2", "--n_heads", "2", "--vocab_size", "64")
READY_TIMEOUT = 180  # a loaded 2-core CI machine needs a while to import torch N times


@dataclass(frozen=True)
class Example:
    argv: tuple[str, ...]        # a run that trains for much longer than any test waits
    ready: str                   # a line printed once training is under way
    quick: tuple[str, ...]       # a run that finishes in seconds, exit status 0
    fault_rank: int              # the rank whose code is made to raise
    fault_target: str            # "module:attribute.path" that raises on its 2nd call
    hung_rank: int | None = None  # ddp_rpc: a rank the driving rank waits on: SIGSTOPped, it must time out
    driver: int = 0              # the rank that then reports the failure
    diverge: tuple[str, ...] = ()  # flags that make the loss non-finite (quick run + these)
    module: str = ""             # the module whose main() argv[0] runs (default: <name>.main)


def module_of(name: str) -> str:
    return EXAMPLES[name].module or f"{name}.main"


EXAMPLES = {
    "rpc_rl": Example(
        ("rpc_rl/main.py", "--world_size", "3", "--max_episodes", "100000", "--log_interval", "1"),
        r"Episode 1\t",
        ("rpc_rl/main.py", "--world_size", "2", "--reward_threshold", "0.5"),
        0, "rpc_rl.agent:Agent.finish_episode"),
    "ddp_rpc": Example(
        ("ddp_rpc/main.py", "--epochs", "100000", "--batches_per_epoch", "2", "--batch_size", "4"),
        r"loss",
        ("ddp_rpc/main.py", "--epochs", "1", "--batches_per_epoch", "1", "--batch_size", "4"),
        0, "torch.distributed.autograd:backward", hung_rank=1, driver=2,
        diverge=("--lr", "1e30", "--epochs", "3", "--batches_per_epoch", "2")),
    "rpc_rnn": Example(
        ("rpc_rnn/main.py", "--epochs", "100000", "--batches", "2"),
        r"loss",
        ("rpc_rnn/main.py", "--epochs", "1", "--batches", "2"),
        1, "torch.distributed.autograd:backward",
        diverge=("--lr", "3e38", "--batches", "3")),
    "rpc_pipeline_resnet": Example(
        ("rpc_pipeline_resnet/main.py", "--batch_size", "4", "--image_size", "32", "--splits", "2",
         "--num_batches", "100000"),
        r"Processing batch",
        ("rpc_pipeline_resnet/main.py", "--batch_size", "4", "--image_size", "32", "--splits", "2",
         "--num_batches", "1"),
        0, "torch.distributed.autograd:backward"),
    # the same ResNet halves with torch.distributed.pipelining: rank 1 computes the loss;
    # --splits 2: one split value, a short run
    "rpc_pipeline_resnet.pipelining": Example(
        ("rpc_pipeline_resnet/pipelining.py", "--batch_size", "4", "--image_size", "32",
         "--splits", "2", "--num_batches", "100000"),
        r"Processing batch",
        ("rpc_pipeline_resnet/pipelining.py", "--batch_size", "4", "--image_size", "32",
         "--splits", "2", "--num_batches", "1"),
        1, "torch.optim.sgd:SGD.step", diverge=("--lr", "1e30", "--num_batches", "2"),
        module="rpc_pipeline_resnet.pipelining"),
    "pipelining_transformer": Example(
        ("pipelining_transformer/main.py", "--world_size", "2", *TINY_GPT, "--steps", "100000"),
        r"step 1/",
        ("pipelining_transformer/main.py", "--world_size", "2", *TINY_GPT, "--steps", "4"),
        1, "torch.optim.adamw:AdamW.step",
        diverge=("--lr", "1e30")),
}


class Job:
    """A CLI run in its own process group, with its output collected as it comes."""

    def __init__(self, argv: tuple[str, ...]) -> None:
        # SIGINT back to its default: a suite started in the background by a shell (`cmd &`,
        # nohup) inherits SIGINT ignored, and Python leaves an ignored SIGINT ignored, so the
        # launcher would never see the Ctrl+C that a user's foreground run gets
        self.proc = subprocess.Popen([sys.executable, *argv], cwd=REPO, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [threading.Thread(target=self._read, args=(s, b), daemon=True)
                         for s, b in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for t in self._readers:
            t.start()

    @staticmethod
    def _read(stream, sink: list[str]) -> None:
        for line in stream:
            sink.append(line)

    def wait_for(self, pattern: str, timeout: float = READY_TIMEOUT) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if any(re.search(pattern, line) for line in list(self.out)):
                return
            if self.proc.poll() is not None:
                pytest.fail(f"exited {self.proc.returncode} before {pattern!r}:\n{self.text()}")
            time.sleep(0.2)
        pytest.fail(f"no {pattern!r} within {timeout} s:\n{self.text()}")

    def workers(self) -> list[int]:
        """PIDs of the spawned workers, in the order they were started (rank order)."""
        kids = children(self.proc.pid)
        return sorted(p for p in kids if b"spawn_main" in cmdline(p))

    def processes(self) -> list[int]:
        """Every live process of the job's session, the launcher's too: also those whose parent is gone
        (a rank orphaned by its launcher's death), and multiprocessing's resource tracker."""
        return [pid for pid in session(self.proc.pid) if pid != self.proc.pid or self.proc.poll() is None]

    def finish(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            for t in self._readers:
                t.join(5)

    def text(self) -> str:
        return "".join(self.out) + "".join(self.err)

    def kill(self) -> None:
        """End the whole job, also when the launcher is gone already: a test that fails (its
        guard broken) must not leave the job's workers running into the tests after it."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the workers share the launcher's group
        except ProcessLookupError:
            pass
        if self.proc.poll() is None:
            self.proc.wait(10)


def children(pid: int) -> list[int]:
    try:
        kids = [int(k) for k in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []
    return kids + [g for k in kids for g in children(k)]


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def session(sid: int) -> list[int]:
    """The live processes of session ``sid`` (a process started with ``start_new_session``: its pid)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _, _, session_id = stat.read_text().rpartition(")")[2].split()[:4]
        except (OSError, ValueError):
            continue
        if int(session_id) == sid and state != "Z":
            found.append(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def assert_all_gone(pids: list[int], within: float) -> None:
    deadline = time.time() + within
    while time.time() < deadline and any(map(alive, pids)):
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)], "processes left behind"


class Here:
    """Stands in for an RRef in one process: rpc_pipeline_resnet's shards call ``to_here()``."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value

    def to_here(self) -> torch.Tensor:
        return self.value


# A pipelining_transformer run's --loss_log, and torchrun's restarted workers.
def keep_weights(module, loop_name: str) -> list[dict]:
    """In a spawned rank of rpc_pipeline_resnet: patch ``module`` (main.py, whose loop is
    ``run_master``; pipelining.py, ``run_pipeline``) so that every run also keeps CPU copies of
    the weights as its model is built (main.py's ``DistResNet50``, pipelining.py's
    ``manual_model_split``) and once its loop has returned. Returns the list they go to, one
    ``{"before": [...], "after": [...]}`` a run: each shard's (RPC, on the master), or this
    rank's stage's, in a list of one."""
    import torch.distributed.rpc as rpc

    loop, kept, built = getattr(module, loop_name), [], []

    def copies(model) -> list[dict]:
        if hasattr(model, "p1_rref"):  # DistResNet50: ask each shard's owner
            return [rpc.rpc_sync(r.owner(), state_copy, args=(r,)) for r in (model.p1_rref, model.p2_rref)]
        return [_cpu_state(model.submod)]  # a PipelineStage

    if loop_name == "run_master":
        class KeptDistResNet50(module.DistResNet50):
            def __init__(self, *args, **kwargs) -> None:
                super().__init__(*args, **kwargs)
                built.append((self, copies(self)))

        module.DistResNet50 = KeptDistResNet50
    else:
        split = module.manual_model_split

        def kept_split(*args, **kwargs):
            stage = split(*args, **kwargs)
            built.append((stage, copies(stage)))
            return stage

        module.manual_model_split = kept_split

    def kept_loop(*args, **kwargs) -> list[float]:
        built.clear()
        losses = loop(*args, **kwargs)
        (model, before), = built  # one model a run
        kept.append({"before": before, "after": copies(model)})
        return losses

    setattr(module, loop_name, kept_loop)
    return kept


def saved_result(fn, rank: int, args: argparse.Namespace):
    """In a rank: run ``fn(rank, args)`` (an example's ``run_worker``) and return what it left with
    ``distkit.save_result`` (None: nothing), kept from the launcher: the test's own worker returns
    it with more beside, and ``distkit.launch`` keeps one value a rank."""
    import distkit

    saved = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(distkit, "save_result", saved.__setitem__)
        fn(rank, args)
    return saved.get(rank)


def _cpu_state(module) -> dict:
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


def state_copy(module_rref) -> dict:
    """On a shard's owner (through RPC): a CPU copy of its weights and BatchNorm statistics."""
    return _cpu_state(module_rref.local_value())


def logged_losses(path: Path) -> list[tuple[int, float]]:
    """The (step, loss) lines that --loss_log wrote to ``path``, in order."""
    return [(e["step"], e["loss"]) for e in map(json.loads, path.read_text().splitlines())]


def workers_by_rank(launcher: int) -> dict[int, int]:
    """The current workers of the torchrun with pid ``launcher`` (or below it),
    {rank: pid}, read from each one's environment."""
    found = {}
    for pid in children(launcher):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        ranks = [int(e.removeprefix(b"RANK=")) for e in env if e.startswith(b"RANK=")]
        if ranks:
            found[ranks[0]] = pid
    return found


def resumed_steps(output: str) -> list[int]:
    """The step each restarted worker said it resumed after, one per rank that said so."""
    return [int(m.group(1)) for m in re.finditer(r"resumed from \S+/step_(\d+) after step \1\n", output)]


def assert_equals_uninterrupted(log: Path, uninterrupted: dict[int, float], resumed_at: int) -> None:
    """Every logged loss, the killed attempt's and the restart's, is the uninterrupted run's."""
    entries = logged_losses(log)
    steps = [s for s, _ in entries]
    restart = max(i for i, s in enumerate(steps) if s == resumed_at + 1)
    assert steps[restart:] == list(range(resumed_at + 1, max(uninterrupted) + 1)), steps
    assert steps[:restart] == list(range(1, restart + 1)), steps  # whole lines, in order
    # bit for bit: the same ranks run the same operations on the same numbers
    assert {s: loss for s, loss in entries} == uninterrupted
    assert all(loss == uninterrupted[s] for s, loss in entries), entries


# assert_close's own tolerances for float32, for Python floats that hold float32 results (a
# loss's .item()): given two floats, it would compare them as float64, to 1e-7.
FLOAT32 = {"rtol": 1.3e-6, "atol": 1e-5}
# A float32 loss below 10 printed to 4 decimals: half its last digit, plus float32's rounding.
PRINTED_4 = 5e-5 + 2e-5


# For a CPU capability torch reports, another that real machines run the same code with:
# AVX-512 machines also run AVX2's kernels, and many machines have only AVX2. Not "default"
# (ATen's scalar kernels) below AVX2: with them in the workers, BatchNorm over micro-batches of
# 2 images moved a ResNet's second loss by 6 % (measured), a mismatch between kernels that no
# run on one machine has.
NARROWER_CAPABILITY = {"AVX512": "avx2"}


@pytest.fixture(autouse=True, scope="session")
def workers_round_differently():
    """Every process a test starts computes with other float rounding than the test's own
    reference, where this CPU allows it: ATen's AVX2 kernels on an AVX-512 machine
    (``ATEN_CPU_CAPABILITY``), so a float32 sum adds in another order, as on a user's
    machine; ranks that share the cores also have fewer intra-op threads than this process.
    A parity test whose tolerance is tuned to this machine's last bits then fails here, not
    there (AVX2 against AVX-512 turned a loss of 0.06872105 into 0.06872070).
    ``test_workers_round_differently`` checks that it holds; yields the value set, or None."""
    import torch

    # read now, so that this process's own kernels are fixed before the variable is set
    native = torch.backends.cpu.get_cpu_capability()
    narrower = NARROWER_CAPABILITY.get(native)
    with pytest.MonkeyPatch.context() as mp:
        if narrower is not None:
            mp.setenv("ATEN_CPU_CAPABILITY", narrower)
        yield narrower


# What the ranks of an in-process launch import: forked from a server that imported them once
PRELOAD = ["torch", "torch.distributed.rpc", "torch.distributed.pipelining", "distkit", "ddp_rpc.main",
           "ddp_rpc.sharded", "rpc_rl.main", "rpc_rnn.main", "rpc_rnn.sharded", "rpc_pipeline_resnet.main",
           "rpc_pipeline_resnet.pipelining", "pipelining_transformer.main"]


@pytest.fixture(autouse=True, scope="session")
def ranks_forked_from_a_server(workers_round_differently, pytestconfig):
    """``distkit.launch`` in this process forks its ranks from a server that imported ``PRELOAD``
    once (tests/forkserver.py): spawn's fresh interpreter imports torch and an example again for
    every rank, about 3 CPU-seconds each. The server starts here, after ``workers_round_differently``
    set its variable. Every example run through its command line (``run_cli``) still starts its
    ranks with ``mp.spawn``; the GPU tier (``-m cuda``) keeps spawn for every launch: it is short,
    and a forkserver has not been tried on a GPU machine."""
    import forkserver

    if gpu_tier(pytestconfig):
        yield False
        return
    forkserver.use(PRELOAD)
    yield True


# Hosts without machines (tests/test_multihost.py, tests/test_slurm.py): network namespaces on a bridge.
IFNAME = "eth0"  # each host's interface; the interface variables name it


@dataclass(frozen=True)
class Host:
    ns: str
    addr: str


def ip(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *argv], capture_output=True, text=True, check=True, timeout=30)


def _teardown(namespaces: list[str]) -> None:
    """Kill what still runs in each namespace (only this test's processes live there), drop it.

    Deleting a namespace also deletes its end of every veth pair, and so the pair.
    """
    for ns in namespaces:
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
        for pid in pids.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@contextlib.contextmanager
def network_hosts(prefix: str, count: int, subnet: str) -> Iterator[list[Host]]:
    """``count`` hosts, each a network namespace ``<prefix>h<i>`` with one veth interface (``eth0``,
    ``<subnet>.<i>/24``) on a bridge that lives in a namespace of its own: nothing is added to this
    machine's own network. Torn down on the way out, with everything still running in them."""
    if os.geteuid() != 0:
        pytest.skip("multi-host tests create network namespaces, which needs root")
    # CI runs as root, and there these tests must run: a missing tool fails them, not skips
    unavailable = pytest.fail if os.environ.get("CI") else pytest.skip
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            unavailable(f"multi-host tests need `{tool}` (iproute2, util-linux)")
    bridge = f"{prefix}br"
    try:
        ip("netns", "add", bridge)
    except subprocess.CalledProcessError as e:
        unavailable(f"`ip netns add` is not available here: {e.stderr.strip()}")
    created = [bridge]
    try:
        ip("-n", bridge, "link", "add", "br0", "type", "bridge")
        ip("-n", bridge, "link", "set", "br0", "up")
        result = []
        for i in range(1, count + 1):
            host = Host(f"{prefix}h{i}", f"{subnet}.{i}")
            ip("netns", "add", host.ns)
            created.append(host.ns)
            # the veth pair is born in the bridge's namespace, its host end moved straight
            # into the host's: nothing ever appears in this machine's own namespace
            ip("-n", bridge, "link", "add", f"p{i}", "type", "veth", "peer", "name", IFNAME, "netns", host.ns)
            ip("-n", bridge, "link", "set", f"p{i}", "master", "br0")
            ip("-n", bridge, "link", "set", f"p{i}", "up")
            ip("-n", host.ns, "link", "set", "lo", "up")
            ip("-n", host.ns, "addr", "add", f"{host.addr}/24", "dev", IFNAME)
            ip("-n", host.ns, "link", "set", IFNAME, "up")
            result.append(host)
        yield result
    finally:
        _teardown(created)


# torch.optim on CUDA: an optimizer given no foreach takes the multi-tensor step there
# (torch.optim's docs: "we default to foreach ... when the tensors are all on CUDA"), the
# one-tensor-at-a-time loop on the CPU. The CPU suite forces CUDA's choice to run that path here.
def _foreach_as_on_cuda(add_param_group, forced: list):
    def add(self, param_group: dict) -> None:
        add_param_group(self, param_group)
        group = self.param_groups[-1]
        if "foreach" in group and group["foreach"] is None and not group.get("fused"):
            group["foreach"] = True  # what a None resolves to for CUDA tensors
            forced.append(type(self).__name__)
    return add


def on_cuda_optimizer_path(fn, rank, args):
    """``fn(rank, args)`` in a rank whose ``torch.optim`` optimizers all take the step CUDA takes
    by default (foreach). ``functools.partial(on_cuda_optimizer_path, run_worker)`` to launch it."""
    import torch

    forced: list[str] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.optim.Optimizer, "add_param_group",
                   _foreach_as_on_cuda(torch.optim.Optimizer.add_param_group, forced))
        result = fn(rank, args)
    # a test of this path that no optimizer took cannot fail: it fails here instead
    assert forced, f"rank {rank} built no torch.optim optimizer whose foreach was left to the device"
    return result
