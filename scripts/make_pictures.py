"""Draw the pictures the example READMEs embed, each from real runs on this machine: scripts/pages.py draws
them into docs/pictures/ (only the generator writes docs/); by hand they go to the git-ignored results/.

Parity, one per example (``<example>_parity.png``): the distributed run's loss per step (rpc_rl: reward
per episode), solid, and the same training in one process, dashed or as markers, on one plot. The
one-process side is the reference the tests compare with (imported from tests/), so the picture shows
exactly what they check, over more steps; ``main`` returns both series, and exits with status 1 if a pair
does not agree to float32 tolerance (``assert_parity``). Two runs differ from the example's default to be
comparable at all: ddp_rpc's trainers wait for each other after each step (the example's updates of the
table are asynchronous), and rpc_pipeline_resnet cuts each batch in 2 micro-batches (see
``RESNET_PARITY_SPLITS``).

Timelines, measured: ``pipelining_transformer_schedules.png`` (GPipe, 1F1B and ZBVZeroBubble on 2 ranks,
each rank's forward, backward and weight-gradient blocks in one training step, recorded by
scripts/stagetrace.py as the benchmark records them) and ``rpc_pipeline_resnet_schedules.png`` (the same
ResNet50 halves pipelined by RPC, main.py, each shard's blocks timed by hooks, and by
torch.distributed.pipelining's GPipe and 1F1B, pipelining.py, by stagetrace). Each panel shows the step
whose slowest rank took the median time of a few: on a shared machine one step can be far off.

    .venv/bin/python scripts/make_pictures.py                          # all, into results/pictures/
    .venv/bin/python scripts/make_pictures.py --quick --out /tmp/pics  # small sizes (tests/test_pictures.py)
    .venv/bin/python scripts/make_pictures.py --only rpc_rl_parity.png

Every run is seeded, on the CPU (gloo), one intra-op thread per process; the ranks are spawned, as the
examples' own main() spawns them.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import astuple, dataclass, field
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
# the one-process references are the tests' own: the pictures show exactly what the tests compare
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))  # distkit and the examples
import distkit  # noqa: E402
from distkit.args import path  # noqa: E402
import stagetrace  # noqa: E402
from resnet_meters import batch_windows, steady_malloc  # noqa: E402
from rpc_phases import saved_by  # noqa: E402

PARITY = ("rpc_rl_parity.png", "ddp_rpc_parity.png", "rpc_rnn_parity.png", "rpc_pipeline_resnet_parity.png",
          "pipelining_transformer_parity.png")
SCHEDULES = ("pipelining_transformer_schedules.png", "rpc_pipeline_resnet_schedules.png")
PICTURES = PARITY + SCHEDULES  # every file this script writes, the names the READMEs embed
OUT = REPO / "results" / "pictures"  # git-ignored: scripts/pages.py draws the pages' into docs/pictures/
# float32 results compared across processes, which may add in another order (never this machine's last bits)
TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}
FIGSIZE, DPI = (8, 4), 100


@dataclass
class Curves:
    """One parity picture's data: the distributed run's series and one process's, step by step."""

    title: str
    xlabel: str
    ylabel: str
    processes: int
    distributed: list[float]
    # the one-process series: ``pick(reference())``, where ``reference`` is a test's own one-process run
    # (a functools.partial of a function of tests/), on one thread; tests/test_pictures.py runs it again
    reference: functools.partial
    pick: Callable[[Any], list[float]]
    note: str = ""  # what the distributed run does beyond the example, for the legend
    one_process: list[float] = field(init=False)

    def __post_init__(self) -> None:
        with one_thread():
            self.one_process = self.pick(self.reference())

    @property
    def steps(self) -> list[int]:
        return list(range(1, len(self.distributed) + 1))


def _first(run: tuple) -> list[float]:
    """A reference's series, where it returns (series, what else the tests read)."""
    return list(run[0])


def assert_parity(curves: Curves) -> None:
    """The two series are one: as many points, each equal to float32 tolerance."""
    assert len(curves.distributed) == len(curves.one_process) > 1, curves
    torch.testing.assert_close(torch.tensor(curves.distributed, dtype=torch.float64),
                               torch.tensor(curves.one_process, dtype=torch.float64), **TOLERANCE,
                               msg=lambda m: f"{curves.title}: {m}")


def example_args(module_name: str, *argv: str) -> argparse.Namespace:
    """``argv`` as the example's own parser and checks leave it, one thread per process."""
    import importlib

    module = importlib.import_module(module_name)
    parser = module.build_parser()
    args = parser.parse_args([*argv, "--threads", "1"])
    module.check_args(parser, args)
    return args


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """This process computes a reference on one thread, as each rank does."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# ---- rpc_rl: reward per episode, one observer, against tests/test_rpc_rl.py's one-process REINFORCE ----

def rpc_rl(quick: bool) -> Curves:
    from rpc_rl.main import run_worker
    from test_rpc_rl import _reinforce_in_one_process

    episodes, seed, gamma = (8 if quick else 40), 1, 0.99
    args = example_args("rpc_rl.main", "--world_size", "2", "--max_episodes", str(episodes),
                        "--log_interval", str(episodes), "--seed", str(seed), "--gamma", str(gamma))
    rewards = distkit.launch(run_worker, args)[0]["rewards"]
    return Curves("rpc_rl: REINFORCE on CartPole-v1, agent and one observer over RPC", "episode",
                  "reward (steps the pole stayed up)", 2, rewards,
                  functools.partial(_reinforce_in_one_process, seed=seed, gamma=gamma, episodes=episodes), _first)


# ---- ddp_rpc: each step's loss (mean over the trainers), against tests/test_ddp_rpc.py's _reference_run ----

def _lockstep_trainer(rank: int, args: argparse.Namespace) -> None:
    """ddp_rpc's run_worker, except that the trainers wait for each other after each optimizer step.

    In the example the table's updates are asynchronous across trainers: a trainer's next lookup may come
    before the other's step has reached the parameter server (docs/ddp_rpc.md), so its losses differ from
    run to run in the 4th digit. Waiting makes the run the synchronous maths one process computes."""
    import torch.distributed as dist
    from ddp_rpc import main as example, trainer

    class SteppedTogether(trainer.DistributedOptimizer):
        def step(self, context_id: int) -> None:
            super().step(context_id)
            dist.barrier()  # the trainers' process group: both tables' steps have landed

    trainer.DistributedOptimizer = SteppedTogether
    example.run_worker(rank, args)  # the master saves its summary


def _mean_per_step(per_rank: list[list[list[float]]]) -> list[float]:
    """Each step's loss, the mean over the trainers (each holding [epoch][batch])."""
    steps = [[x for epoch in rank for x in epoch] for rank in per_rank]
    return [sum(step) / len(step) for step in zip(*steps)]


def ddp_rpc(quick: bool) -> Curves:
    from test_ddp_rpc import _reference_run

    epochs, batches = (2, 3) if quick else (10, 4)
    args = example_args("ddp_rpc.main", "--epochs", str(epochs), "--batches_per_epoch", str(batches),
                        "--batch_size", "16", "--seed", "0", "--lr", "0.05", "--device", "cpu")
    out = distkit.launch(_lockstep_trainer, args)[args.world_size - 2]  # the master's summary
    reports = out["trainers"]
    return Curves(f"ddp_rpc: {len(reports)} DDP trainers, a parameter server and a master "
                  f"({epochs} epochs of {batches} batches)", "step", f"loss (mean of the {len(reports)} trainers)",
                  args.world_size, _mean_per_step([r.losses for r in reports]),
                  functools.partial(_reference_run, out["emb_before"], reports[0].fc_before, out["config"],
                                    len(reports)), lambda run: _mean_per_step(run[0]),
                  note=", the trainers stepping in lockstep")


# ---- rpc_rnn: each epoch's mean loss, against tests/test_rpc_rnn.py's reference_training ----

def rpc_rnn(quick: bool) -> Curves:
    from test_rpc_rnn import keeping_weights, reference_training

    epochs, batches = (4, 5) if quick else (10, 40)
    args = example_args("rpc_rnn.main", "--epochs", str(epochs), "--batches", str(batches), "--dropout", "0",
                        "--device", "cpu")
    out = distkit.launch(keeping_weights, args)[1]  # the trainer's
    return Curves("rpc_rnn: parameter server (embedding, decoder) and trainer (LSTM)", "epoch",
                  "loss (mean over the epoch's batches)", 2, out["losses"],
                  functools.partial(reference_training, args, out["initial"]), _first)


# ---- rpc_pipeline_resnet: the RPC pipeline's loss per batch, against tests/test_resnet_two_pipelines.py ----

# With 2 micro-batches a batch, each parameter's gradient is the sum of two terms, the same in either
# order; with more, RPC adds them as they arrive. This ResNet, trained from scratch on random images with
# BatchNorm over a few values, turns such a last-bit difference into percents within three batches (a
# thousandfold a batch, measured): the test compares 4 micro-batches over 2 batches, the picture 2 over more.
RESNET_PARITY_SPLITS = 2


def rpc_pipeline_resnet(quick: bool) -> Curves:
    import test_resnet_two_pipelines as two  # its sizes, seeds, learning rate and one-process training
    from rpc_pipeline_resnet.main import run_worker

    batches = 3 if quick else 8  # run_master returns every batch's loss
    args = example_args("rpc_pipeline_resnet.main", *two.COMMON, "--num_batches", str(batches),
                        "--splits", str(RESNET_PARITY_SPLITS), "--device", "cpu")
    run = distkit.launch(run_worker, args)[0][0]  # the master's one run
    return Curves(f"rpc_pipeline_resnet: ResNet50 in two shards over RPC, {RESNET_PARITY_SPLITS} micro-batches "
                  f"a batch", "batch", "loss (MSE)", 3, run["losses"],
                  functools.partial(two.one_process, RESNET_PARITY_SPLITS, batches), _first)


# ---- pipelining_transformer: the loss per step, against tests/test_pipelining_transformer.py's _one_process ----

def pipelining_transformer(quick: bool) -> Curves:
    from pipelining_transformer.main import run_worker
    from test_pipelining_transformer import TINY, _one_process

    steps = 6 if quick else 25
    # the test's model and SGD (a step linear in the gradient), twice as wide and with a smaller step: the
    # loss falls over the whole run, and the rounding of two processes stays in the last digits
    args = example_args("pipelining_transformer.main", *TINY, "--n_layers", "4", "--world_size", "2",
                        "--steps", str(steps), "--dim", "32", "--lr", "0.05", "--device", "cpu")
    results = distkit.launch(run_worker, args)
    losses = next(r for r in results.values() if r)  # main.py's run_worker: the last stage's losses
    return Curves(f"pipelining_transformer: GPipe on 2 ranks, {args.n_microbatches} micro-batches", "step",
                  "loss (cross-entropy)", 2, losses, functools.partial(_one_process, args), list)


# ---- the schedules' measured timelines ----

_shard_spans: list[stagetrace.Span] = []  # in a shard's process: the forwards and backwards it ran
_hooking = threading.Lock()


def _record_shard(shard: torch.nn.Module, rank: int) -> None:
    """Hooks on an RPC shard, in its process: a span per forward (from inside its lock: the compute, not
    the wait for its input or for the lock) and per backward (from its output's gradient to the last
    gradient it computes: its input's where that needs one, shard 2, else its first convolution's)."""
    stage, tail = (1, shard.fc) if getattr(shard, "fc", None) is not None else (0, shard.seq)
    count, now = itertools.count(), {}

    def backward_ends(n: int, started: list[float]) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            if started:
                _shard_spans.append(stagetrace.Span(rank, "B", started.pop(), stagetrace.clock(), stage, n))
        return hook

    def forward_starts(module: torch.nn.Module, inputs: tuple) -> None:
        now.update(start=stagetrace.clock(), n=next(count), started=[])
        if inputs[0].requires_grad:
            inputs[0].register_hook(backward_ends(now["n"], now["started"]))

    def first_layer_ran(module: torch.nn.Module, inputs: tuple, out: torch.Tensor) -> None:
        if not inputs[0].requires_grad and out.grad_fn is not None:
            out.grad_fn.register_hook(backward_ends(now["n"], now["started"]))

    def forward_ends(module: torch.nn.Module, inputs: tuple, out: torch.Tensor) -> None:
        _shard_spans.append(stagetrace.Span(rank, "F", now["start"], stagetrace.clock(), stage, now["n"]))
        started = now["started"]
        out.register_hook(lambda grad: started.append(stagetrace.clock()))

    shard.seq.register_forward_pre_hook(forward_starts)
    shard.seq[0].register_forward_hook(first_layer_ran)
    tail.register_forward_hook(forward_ends)


def _trace_shards(rank: int) -> None:
    """In this process, every shard built from now on records its spans on its first forward."""
    from rpc_pipeline_resnet.model import ResNetShard1, ResNetShard2

    for cls in (ResNetShard1, ResNetShard2):
        def traced_forward(self: Any, x_rref: Any, forward: Callable = cls.forward) -> torch.Tensor:
            with _hooking:  # the first micro-batches arrive at once, each on an RPC thread
                if not getattr(self, "traced", False):
                    _record_shard(self, rank)
                    self.traced = True
            return forward(self, x_rref)
        cls.forward = traced_forward


def _take_shard_spans() -> list[tuple]:
    """Through RPC, on a shard's process: its spans so far, as tuples (and then none)."""
    spans = [astuple(s) for s in _shard_spans]
    _shard_spans.clear()
    return spans


class _Marks:
    """A window of ``batch_windows`` (scripts/resnet_meters.py, as the benchmark's meters): each batch's
    start and end on the shared clock."""

    def __init__(self) -> None:
        self.marks: list[tuple[float, float]] = []

    def start(self, model: Any) -> None:
        self._start = stagetrace.clock()

    def end(self) -> None:
        self.marks.append((self._start, stagetrace.clock()))
        stagetrace.end_step()


def _rpc_resnet_worker(rank: int, args: argparse.Namespace) -> list[dict] | None:
    """main.py's run_worker; the master's runs also hold each batch's start and end and the shards' spans."""
    import torch.distributed.rpc as rpc
    import rpc_pipeline_resnet.main as example

    steady_malloc()  # as the benchmark: freed memory kept, so that no batch page-faults it back in
    _trace_shards(rank)
    traces, run_master = [], example.run_master

    def traced_run_master(num_split: int, a: argparse.Namespace, devices: list) -> list[float]:
        window = _Marks()
        with batch_windows(example, window):
            losses = run_master(num_split, a, devices)
        spans = [s for name in example.WORKERS for s in rpc.rpc_sync(name, _take_shard_spans)]
        traces.append({"marks": window.marks, "spans": spans})
        return losses

    example.run_master = traced_run_master
    runs = saved_by(example.run_worker, rank, args)  # the master's runs; a shard's: None
    return runs and [run | trace for run, trace in zip(runs, traces)]


def _pp_resnet_worker(rank: int, args: argparse.Namespace) -> list[dict]:
    """pipelining.py's run_worker; each run also holds this rank's batches' starts and ends and its spans
    (scripts/stagetrace.py's, as the benchmarks record them)."""
    import rpc_pipeline_resnet.pipelining as example

    steady_malloc()
    recorder = stagetrace.Recorder(rank)
    stagetrace.record_into(recorder)
    traces, run_pipeline = [], example.run_pipeline

    def traced_run_pipeline(num_split: int, a: argparse.Namespace, rank: int, device: torch.device
                            ) -> list[float]:
        window = _Marks()
        with batch_windows(example, window):
            losses = run_pipeline(num_split, a, rank, device)
        spans, recorder.spans = recorder.spans, []
        traces.append({"marks": window.marks, "spans": [astuple(s) for s in spans]})
        return losses

    example.run_pipeline = traced_run_pipeline
    return [run | trace for run, trace in zip(saved_by(example.run_worker, rank, args), traces)]


@dataclass
class Timeline:
    """One panel: a row per rank (or shard) with the compute spans it measured in one step."""

    title: str
    rows: list[tuple[str, list[stagetrace.Span]]]

    @property
    def start(self) -> float:
        return min(s.start for _, spans in self.rows for s in spans)

    @property
    def seconds(self) -> float:
        return max(s.end for _, spans in self.rows for s in spans) - self.start


TRANSFORMER_SCHEDULES = ("GPipe", "1F1B", "ZBVZeroBubble")
MICROBATCHES = 4  # in every timeline


def median_step(seconds_per_rank: list[list[float]], warmup: int = 1) -> int:
    """The step (after ``warmup``) whose slowest rank took the median time: on a shared machine one
    step can be far off the others."""
    slowest = [max(ranks) for ranks in zip(*seconds_per_rank)][warmup:]
    return warmup + sorted(range(len(slowest)), key=slowest.__getitem__)[len(slowest) // 2]


def pipelining_transformer_schedules(quick: bool) -> list[Timeline]:
    """Each schedule on 2 ranks, 4 micro-batches: the median of a few steps, as the benchmark records them
    (scripts/bench_pipelining_transformer.py's ``pipeline_worker``: the example's run_worker, stagetrace on)."""
    import bench_pipelining_transformer as bench
    from distkit.schedules import stage_indices_for

    dim, layers, heads, vocab = (64, 4, 4, 512) if quick else (256, 8, 8, 2000)
    timelines = []
    for schedule in TRANSFORMER_SCHEDULES:
        args = example_args("pipelining_transformer.train", "--world_size", "2", "--schedule", schedule,
                            "--n_microbatches", str(MICROBATCHES), "--batch_size", "8", "--seq_len", "32",
                            "--dim", str(dim), "--n_layers", str(layers), "--n_heads", str(heads),
                            "--vocab_size", str(vocab), "--steps", str(TIMED_STEPS[quick] + 1), "--seed", "0",
                            "--device", "cpu")
        ranks = distkit.launch(bench.pipeline_worker, args)
        step = median_step([ranks[r]["schedule"] for r in sorted(ranks)])
        rows = []
        for rank in sorted(ranks):
            stages = stage_indices_for(schedule, rank, args.world_size)
            label = f"rank {rank}\nstage{'s' * (len(stages) > 1)} {', '.join(map(str, stages))}"
            spans = [stagetrace.Span(*t) for t in ranks[rank]["spans"][step]]
            rows.append((label, [s for s in spans if s.kind in stagetrace.COMPUTE]))
        timelines.append(Timeline(schedule, rows))
    return timelines


TIMED_STEPS = {True: 2, False: 5}  # steps (or batches) measured after a first one, by --quick


def _batch(trace: dict, i: int) -> list[stagetrace.Span]:
    """The compute spans of batch ``i`` of a run (``_Marks``' window on the shared clock)."""
    start, end = trace["marks"][i]
    spans = [stagetrace.Span(*t) for t in trace["spans"]]
    return [s for s in spans if start <= s.start < end and s.kind in stagetrace.COMPUTE]


def _batch_seconds(trace: dict) -> list[float]:
    return [end - start for start, end in trace["marks"]]


def rpc_pipeline_resnet_schedules(quick: bool) -> list[Timeline]:
    """The ResNet halves, 4 micro-batches, pipelined by RPC (main.py) and by pipelining.py's GPipe and
    1F1B: a warm-up batch, then the median of a few."""
    import test_resnet_two_pipelines as two

    batch, image = (two.BATCH, two.IMAGE) if quick else (16, 64)
    # a first batch (median_step leaves it out), then the timed ones
    argv = [*two.COMMON, "--batch_size", str(batch), "--image_size", str(image),
            "--num_batches", str(1 + TIMED_STEPS[quick]), "--splits", str(MICROBATCHES), "--device", "cpu"]
    run = distkit.launch(_rpc_resnet_worker, example_args("rpc_pipeline_resnet.main", *argv))[0][0]
    spans = [stagetrace.Span(s.rank, s.kind, s.start, s.end, s.stage, s.microbatch % MICROBATCHES)
             for s in _batch(run, median_step([_batch_seconds(run)]))]  # numbered as they reached the shard
    timelines = [Timeline("RPC (main.py; micro-batches numbered as they reached the shard)",
                          [(f"shard {k + 1}\nworker{k + 1}", [s for s in spans if s.stage == k]) for k in (0, 1)])]
    for schedule in ("GPipe", "1F1B"):
        args = example_args("rpc_pipeline_resnet.pipelining", *argv, "--world_size", "2", "--schedule", schedule)
        ranks = distkit.launch(_pp_resnet_worker, args)
        i = median_step([_batch_seconds(ranks[r][0]) for r in sorted(ranks)])
        timelines.append(Timeline(f"{schedule} (pipelining.py)",
                                  [(f"rank {r}\nstage {r}", _batch(ranks[r][0], i)) for r in sorted(ranks)]))
    return timelines


# ---- drawing ----

KIND_STYLE = {"F": ("tab:blue", "forward"), "B": ("tab:orange", "backward"), "W": ("tab:green", "weight gradients")}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path, rect: tuple[float, ...] = (0, 0, 1, 1)) -> None:
    fig.tight_layout(rect=rect)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    _pyplot().close(fig)


def draw_parity(curves: Curves, path: Path) -> None:
    from matplotlib.ticker import MaxNLocator

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=FIGSIZE)
    x = curves.steps
    ax.plot(x, curves.distributed, "-", color="tab:blue", lw=4, alpha=0.5,
            label=f"distributed ({curves.processes} processes{curves.note})")
    if len(x) <= 40:
        ax.plot(x, curves.one_process, "o", mfc="none", mec="black", ms=6, label="one process")
    else:
        ax.plot(x, curves.one_process, "--", color="black", lw=1.2, label="one process")
    gap = max(abs(a - b) for a, b in zip(curves.distributed, curves.one_process))
    ax.plot([], [], " ", label=f"largest difference: {gap:.1g}")
    ax.set_title(curves.title, fontsize=10)
    ax.set(xlabel=curves.xlabel, ylabel=curves.ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend()
    _save(fig, path)


def _lanes(spans: list[stagetrace.Span]) -> tuple[list[int], int]:
    """A lane per span, so that spans running at once (an RPC shard's concurrent backwards) sit one above
    the other; and how many lanes that takes."""
    ends: list[float] = []
    lanes = []
    for s in spans:
        lane = next((i for i, end in enumerate(ends) if end <= s.start), len(ends))
        if lane == len(ends):
            ends.append(s.end)
        ends[lane] = s.end
        lanes.append(lane)
    return lanes, max(1, len(ends))


def draw_timelines(timelines: list[Timeline], title: str, path: Path) -> None:
    from matplotlib.patches import Patch

    plt = _pyplot()
    fig, axes = plt.subplots(len(timelines), 1, figsize=FIGSIZE, sharex=True)
    longest = max(t.seconds for t in timelines) * 1e3
    kinds: set[str] = set()
    lighter = False
    for ax, timeline in zip(axes, timelines):
        t0 = timeline.start
        for row, (label, spans) in enumerate(timeline.rows):
            spans = sorted(spans, key=lambda s: s.start)
            lanes, n_lanes = _lanes(spans)
            first_stage = min((s.stage for s in spans if s.stage is not None), default=None)
            for s, lane in zip(spans, lanes):
                kinds.add(s.kind)
                height = 0.8 / n_lanes
                y = row - 0.4 + lane * height
                start, width = (s.start - t0) * 1e3, (s.end - s.start) * 1e3
                second = s.stage is not None and s.stage != first_stage  # a V's second stage on this rank
                lighter |= second
                ax.broken_barh([(start, width)], (y, height), facecolors=KIND_STYLE[s.kind][0],
                               alpha=0.45 if second else 1.0, edgecolor="white", linewidth=0.6)
                if s.microbatch is not None and width > 0.018 * longest and height > 0.3:
                    ax.text(start + width / 2, y + height / 2, str(s.microbatch), ha="center", va="center",
                            fontsize=7, color="black" if second else "white")
        ax.set_yticks(range(len(timeline.rows)), [label for label, _ in timeline.rows], fontsize=7)
        ax.set_ylim(len(timeline.rows) - 0.5, -0.5)
        ax.set_title(f"{timeline.title}: {timeline.seconds * 1e3:.0f} ms", fontsize=9, loc="left")
        ax.grid(axis="x", alpha=0.3)
    axes[-1].set_xlim(0, longest * 1.01)
    axes[-1].set_xlabel("ms from the step's first computation (the numbers: micro-batches)")
    handles = [Patch(color=KIND_STYLE[k][0], label=KIND_STYLE[k][1]) for k in ("F", "B", "W") if k in kinds]
    if "W" in kinds:  # where weight gradients are deferred, a backward computes the input's gradient only
        handles[1].set_label("backward (zero-bubble: input gradients only)")
    if lighter:
        handles.append(Patch(facecolor="0.5", alpha=0.45, label="lighter: the rank's second stage"))
    fig.legend(handles=handles, loc="lower center", fontsize=8, ncols=len(handles), frameon=False)
    fig.suptitle(title, fontsize=10)
    _save(fig, path, rect=(0, 0.05, 1, 1))  # the legend below


# ---- the script ----

MAKERS: dict[str, Callable[[bool], Any]] = {
    "rpc_rl_parity.png": rpc_rl,
    "ddp_rpc_parity.png": ddp_rpc,
    "rpc_rnn_parity.png": rpc_rnn,
    "rpc_pipeline_resnet_parity.png": rpc_pipeline_resnet,
    "pipelining_transformer_parity.png": pipelining_transformer,
    "pipelining_transformer_schedules.png": pipelining_transformer_schedules,
    "rpc_pipeline_resnet_schedules.png": rpc_pipeline_resnet_schedules,
}
TITLES = {
    "pipelining_transformer_schedules.png": "pipelining_transformer: one training step on 2 ranks, measured "
                                            "(the median of a few)",
    "rpc_pipeline_resnet_schedules.png": "rpc_pipeline_resnet: the same two ResNet50 halves, one batch measured "
                                         "(the median of a few)",
}


def build_parser() -> argparse.ArgumentParser:
    p = distkit.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes (the test's): about a minute on 2 cores")
    p.add_argument("--out", type=path("out_dir"), default=str(OUT), metavar="DIR", help="where the PNGs go")
    p.add_argument("--only", nargs="+", choices=PICTURES, default=None, metavar="NAME",
                   help=f"make these only (default: all of {', '.join(PICTURES)})")
    return p


def main(argv: list[str] | None = None) -> dict[str, Curves | list[Timeline]]:
    """Make the pictures; returns each one's data (a parity picture's ``Curves``, a timeline's panels).
    Exits with status 1, after drawing them all, if a parity picture's two series disagree."""
    parser = build_parser()
    args = parser.parse_args(argv)
    out, made, disagree = Path(args.out), {}, []
    for name in dict.fromkeys(args.only or PICTURES):
        start = time.perf_counter()
        data = MAKERS[name](args.quick)
        if isinstance(data, Curves):
            draw_parity(data, out / name)
            try:
                assert_parity(data)
            except AssertionError as e:
                disagree.append(f"{name}: {e}")
        else:
            draw_timelines(data, TITLES[name], out / name)
        made[name] = data
        print(f"{out / name}: {time.perf_counter() - start:.0f} s", flush=True)
    if disagree:
        print("error: the distributed run and one process disagree in " + "; ".join(disagree), file=sys.stderr)
        raise SystemExit(1)
    return made


if __name__ == "__main__":
    import make_pictures  # the ranks unpickle this module's worker functions by this name, not __main__'s

    make_pictures.main()
