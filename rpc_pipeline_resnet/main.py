"""Distributed pipeline parallelism with RPC: ResNet50 in two shards on two workers.

Mirrors "Distributed Pipeline Parallelism Using RPC" (upstream: pytorch/examples
rpc/pipeline/main.py). Three processes, roles by rank:
  rank 0  "master": holds DistResNet50 (RRefs to the shards), makes the data, computes the
          loss, runs dist_autograd.backward and the DistributedOptimizer step
  rank 1  "worker1": owns ResNetShard1 (conv1 .. layer2)
  rank 2  "worker2": owns ResNetShard2 (layer3 .. fc)
Each batch is cut into N micro-batches ("splits") that flow through the two shards as a
pipeline; the master trains a fresh model for every N in --splits (the same initial
weights for every N: --seed) and times it.

Run on one machine (spawns the three processes; CPU + gloo unless GPUs are visible: with
two GPUs the shards use cuda:0 and cuda:1, with one they share cuda:0):
    python rpc_pipeline_resnet/main.py
    python rpc_pipeline_resnet/main.py --batch_size 120 --image_size 128 --splits 1 2 4 8
One rank per process under torchrun works too:
    torchrun --nproc_per_node 3 rpc_pipeline_resnet/main.py
Prints "number of splits = N, execution time = T" for each N, then a table: every speed-up
beside the machine's bound (and the classic two-stage 2m/(m+1)). Measured timelines:
    python rpc_pipeline_resnet/main.py --splits 1 4 --trace traces/   # Perfetto JSON + PNG
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn as nn
import torch.optim as optim
from torch.distributed.optim import DistributedOptimizer

import distkit
from distkit.timeline import (Recorder, clock, plot_timelines, spans_from_dicts, spans_to_dicts,
                              write_chrome_trace)
from rpc_pipeline_resnet.measure import (batch_floor, process_stats, report, state_digest,
                                         steady_malloc)
from rpc_pipeline_resnet.model import NUM_CLASSES, DistResNet50

log = logging.getLogger(__name__)

WORKERS = ["worker1", "worker2"]


def build_parser() -> argparse.ArgumentParser:
    parser = distkit.ArgumentParser(description="Pipeline-parallel ResNet50 over RPC")
    parser.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8], metavar="N",
                        help="numbers of micro-batches per batch to train and time, one run each")
    parser.add_argument("--batch_size", type=int, default=16, help="images per batch")
    parser.add_argument("--image_size", type=int, default=128, help="image width and height")
    parser.add_argument("--num_batches", type=int, default=3, help="timed batches per run")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed batches first (memory and oneDNN set-up would otherwise "
                             "slow down whichever run comes first)")
    parser.add_argument("--num_classes", type=int, default=NUM_CLASSES, help="classes (fc outputs)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the data")
    parser.add_argument("--trace", default=None, metavar="DIR",
                        help="write measured per-rank timelines here: splits_N.json (Chrome "
                             "trace events, opens in Perfetto) per split value, timeline.png")
    parser.add_argument("--default_malloc", action="store_true",
                        help="leave glibc's malloc settings alone (page faults then make the "
                             "timings depend on what ran before; see the README)")
    distkit.add_launch_args(parser, world_size=3, rpc_timeout=120)
    return parser


def feature_size(image_size: int, halvings: int) -> int:
    """Height (= width) after conv1, maxpool, layer2, layer3, layer4 (in that order, each
    halving and rounding up) have run ``halvings`` of them."""
    size = image_size
    for _ in range(halvings):
        size = (size - 1) // 2 + 1
    return size


def final_feature_size(image_size: int) -> int:
    """Height (= width) of layer4's output."""
    return feature_size(image_size, 5)


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    distkit.check_launch_args(parser, args, min_world_size=3, max_world_size=3)
    for name in ("batch_size", "image_size", "num_batches", "num_classes"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be at least 0, got {args.warmup}")
    distkit.require_positive(parser, "--lr", args.lr)
    for n in args.splits:
        if not 1 <= n <= args.batch_size:
            parser.error(f"--splits values must be in 1..{args.batch_size} (--batch_size), got {n}")
    smallest = args.batch_size // max(args.splits)
    in_layer3 = smallest * feature_size(args.image_size, 4) ** 2
    in_layer4 = smallest * final_feature_size(args.image_size) ** 2
    if in_layer3 < 4 or in_layer4 < 2:
        # BatchNorm in training mode normalises each channel over the micro-batch's values: one
        # value has no variance, and with two in layer3 and again in layer4 the gradients blow
        # up and the loss turns nan (batch 16, 8x8 images, 8 splits; tests/test_rpc_pipeline_resnet.py)
        parser.error(f"micro-batches of {smallest} image(s) of {args.image_size}x{args.image_size} "
                     f"give BatchNorm {in_layer3} value(s) per channel in layer3 and {in_layer4} in "
                     f"layer4 (training needs 4 and 2); use a larger --image_size or fewer splits")
    distkit.check_placements(parser, args, placement)


def placement(worker: distkit.Worker, args: argparse.Namespace) -> distkit.Placement:
    """The master: the CPU. Shard i (rank i + 1): cuda:i with two GPUs on its machine, both
    shards on cuda:0 with one, the CPU with none (what ``run_master`` asks each worker)."""
    if worker.rank == 0:
        return distkit.Placement(torch.device("cpu"))
    return distkit.Placement(distkit.pick_device(args.device, worker.rank - 1))


def all_stats() -> list[dict]:
    """process_stats of the master, worker1 and worker2, read as close together as RPC allows."""
    futures = [rpc.rpc_async(name, process_stats) for name in WORKERS]
    return [process_stats(), *(f.wait() for f in futures)]


def _digest(module_rref) -> str:
    return state_digest(module_rref.local_value())


def run_master(num_split: int, args: argparse.Namespace, states: bool = False) -> dict:
    """Train a fresh DistResNet50 for --num_batches batches cut into ``num_split`` micro-batches.

    ``states``: also return both shards' weights and BatchNorm statistics before the first
    batch and after the last (CPU copies: what tests compare with one process).
    """
    # each worker picks its shard's device itself: it knows its own GPUs (shard i gets
    # cuda:i with two GPUs, both share cuda:0 with one, CPU with none or --device cpu)
    devices = [rpc.rpc_sync(name, distkit.pick_device, args=(args.device, i))
               for i, name in enumerate(WORKERS)]
    # put the two model parts on worker1 and worker2 respectively; built from --seed, so
    # every split value starts from the same weights
    trace = getattr(args, "trace", None) is not None  # a Namespace built by hand may lack it
    model = DistResNet50(num_split, WORKERS, devices, num_classes=args.num_classes,
                         seed=args.seed, trace=trace)
    digests = [rpc.rpc_sync(r.owner(), _digest, args=(r,)) for r in (model.p1_rref, model.p2_rref)]
    loss_fn = nn.MSELoss()
    opt = DistributedOptimizer(optim.SGD, model.parameter_rrefs(), lr=args.lr)
    initial = model.shard_states() if states else None
    rec = Recorder(0)

    # the same seeded data for every num_split, so the runs differ only in pipelining
    gen = torch.Generator().manual_seed(args.seed)
    one_hot_indices = torch.randint(0, args.num_classes, (args.batch_size, 1), generator=gen)
    losses, batch_times, cpu_times, windows = [], [], [0.0, 0.0], []
    batch_cpu, floor_times, faults = [], [], []
    for i in range(args.warmup + args.num_batches):
        timed = i >= args.warmup
        log.info(f"Processing batch {i}" + ("" if timed else " (warm-up, not timed)"))
        # generate random inputs and labels
        inputs = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=gen)
        labels = torch.zeros(args.batch_size, args.num_classes).scatter_(1, one_hot_indices, 1)
        # the wall clock runs from before the CPU clocks are read to after they are read
        # again: every CPU second they count falls inside it, so CPU / cores <= wall holds
        tik = clock()
        before = all_stats()
        # the context collects the gradients on every worker the forward pass touched; there
        # is no zero_grad because each batch gets a fresh context (and fresh gradients)
        with dist_autograd.context() as context_id:
            t0 = clock()
            outputs = model(inputs)
            t1 = clock()
            loss = loss_fn(outputs, labels)
            t2 = clock()
            dist_autograd.backward(context_id, [loss])
            t3 = clock()
            opt.step(context_id)
            t4 = clock()
        after = all_stats()
        tok = clock()
        for kind, start, end in (("recv", t0, t1), ("loss", t1, t2), ("wait", t2, t3),
                                 ("step", t3, t4)):
            rec.add(kind, start, end)  # the master waits for logits, gradients, the step
        windows.append((tik, tok))
        if timed:
            batch_times.append(tok - tik)
            cpu, floor, n_faults = batch_floor(before, after)
            batch_cpu.append(cpu)
            floor_times.append(floor)
            faults.append(n_faults)
            cpu_times = [t + a["cpu"] - b["cpu"] for t, b, a in zip(cpu_times, before[1:], after[1:])]
        losses.append(distkit.check_finite(loss.item(), f"batch {i} with {num_split} splits"))
    log.info(f"number of splits = {num_split}, execution time = {sum(batch_times)}")
    spans = spans_to_dicts(rec.spans) + model.take_spans() if trace else []
    result = {"num_split": num_split, "time": sum(batch_times), "losses": losses,
              "batch_times": batch_times, "cpu_times": cpu_times, "devices": [str(d) for d in devices],
              # measured CPU work (all three processes) and the wall time it needs at least
              "batch_cpu": batch_cpu, "floor": sum(floor_times), "faults": faults,
              "init_digests": digests, "windows": windows[args.warmup:], "spans": spans}
    if states:
        result |= {"before": initial, "after": model.shard_states()}
    return result


def rpc_backend_options(args: argparse.Namespace) -> rpc.TensorPipeRpcBackendOptions:
    # TensorPipe's shared-memory transport busy-polls, about 15% of a core per process even
    # when idle (measured): on 2 cores that is time stolen from the shards. TCP over loopback
    # ("uv") does not, and it is what runs between machines anyway.
    return rpc.TensorPipeRpcBackendOptions(num_worker_threads=128, rpc_timeout=args.rpc_timeout,
                                           _transports=["uv"])


def run_worker(worker: distkit.Worker, args: argparse.Namespace) -> list[dict] | None:
    """Rank 0 is the master and trains; ranks 1 and 2 host the shards and wait for its RPCs."""
    if not getattr(args, "default_malloc", False):
        steady_malloc()  # before the large tensors: see measure.py
    torch.manual_seed(args.seed + worker.rank)
    distkit.silence_torchscript_optimizer_warning()  # DistributedOptimizer's, see the README
    options = rpc_backend_options(args)
    if worker.rank == 0:
        rpc.init_rpc("master", rank=0, world_size=worker.world_size, rpc_backend_options=options)
        results = [run_master(num_split, args) for num_split in args.splits]
    else:
        if args.threads is None:
            # the master only computes the loss: the two shards share this machine's cores
            # (one thread each on 2 cores), so both can run at the same time
            torch.set_num_threads(distkit.threads_per_process(min(2, worker.local_world_size)))
        rpc.init_rpc(WORKERS[worker.rank - 1], rank=worker.rank, world_size=worker.world_size,
                     rpc_backend_options=options)
        results = None
    # block until all rpcs finish
    rpc.shutdown()
    return results


def write_trace(directory: str, runs: list[dict]) -> list[Path]:
    """splits_N.json per split value (all ranks, one clock) and timeline.png (last timed batch)."""
    paths, panels = [], []
    for run in runs:
        spans = spans_from_dicts(run["spans"])
        m = run["num_split"]
        paths.append(write_chrome_trace(Path(directory) / f"splits_{m}.json", spans))
        start, end = run["windows"][-1]
        last = [s for s in spans if start <= s.start <= end]
        panels.append((f"{m} split{'s' * (m > 1)}: last timed batch, {end - start:.2f} s "
                       f"(rank 0 master, rank 1 shard 1, rank 2 shard 2)", last))
    paths.append(plot_timelines(Path(directory) / "timeline.png", panels,
                                title="rpc_pipeline_resnet: measured timeline per rank"))
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    runs = distkit.launch(run_worker, args).get(0)
    if runs is None:  # a torchrun rank other than 0
        return 0
    print(f"devices: worker1 {runs[0]['devices'][0]}, worker2 {runs[0]['devices'][1]}; batches of "
          f"{args.batch_size} x 3 x {args.image_size} x {args.image_size}; {args.num_batches} timed "
          f"after {args.warmup} warm-up")
    # speed-up over the fewest splits; bound: the machine's (the base's CPU work over the
    # cores); 2m/(m+1): two equal serial stages, which these shards are not (the README);
    # busy = CPU seconds of all three processes / wall seconds (at most the cores);
    # work = CPU seconds / the base's; faults: page faults per batch, all processes
    print("splits  time (s)  speed-up  bound  2m/(m+1)  busy  work  shard CPU (s)  faults  "
          "loss of each batch")
    for r in report(runs):
        print(f"{r['splits']:6d}  {r['time']:8.2f}  {r['speed-up']:7.2f}x {r['bound']:5.2f}x "
              f"{r['classic']:8.2f}x  {r['busy']:4.2f}  {r['work']:4.2f}  "
              f"{r['cpu'][0]:6.2f} {r['cpu'][1]:6.2f}  {r['faults']:6.0f}  "
              f"{' '.join(f'{x:.4f}' for x in r['losses'])}{'  ' + r['flag'] if r['flag'] else ''}")
    if args.trace is not None:
        for path in write_trace(args.trace, runs):
            print(f"trace written to {path}")
    return 0


if __name__ == "__main__":
    distkit.exit_process(main())
