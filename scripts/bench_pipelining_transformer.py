"""Benchmark pipelining_transformer: step time, tokens/s, memory and bubble per schedule and m.

The example's ``init_distributed`` and ``train`` unchanged, beside one process with the whole model and as many
threads. Bubble = 1 - compute (stagetrace.py's spans) / schedule time, beside the ideal
(pipeline_plan.py). --sweep: over work per micro-batch, against one process and p m / (m + p - 1).
Usage, every column: docs/pipelining_transformer_benchmark.md#benchmark.
"""
from __future__ import annotations

import argparse
import functools
import math
import resource
import time
from collections.abc import Callable
from dataclasses import astuple

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

from benchlib import (bench_parser, check_at_least, describe_machine, example_args, format_table, median, parse,
                      save_plot, wrap_schedule_steps)
import distkit
import pipelining_transformer.train as example
from distkit.schedules import SCHEDULES, num_stages_for, schedule_problem, stage_indices_for
from pipelining_transformer.cli import layer_count
from pipelining_transformer.model import Transformer, make_optimizer, synthetic_batch, tokenwise_loss_fn
from pipeline_plan import plan
import stagetrace

HEADER = ["schedule", "split", "m", "step ms", "tokens/s", "local step ms", "local tokens/s", "speed-up",
          "1-thread step ms", "x 1 thread", "bound", "balance", "bubble", "ideal bubble", "peak MB/rank",
          "local peak MB"]
QUICK_SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B"]


def timed(fn: Callable, on_done: Callable[[float, float], None]) -> Callable:
    """``fn``, each call's start and end (perf_counter) handed to ``on_done``."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            on_done(start, time.perf_counter())
    return wrapper


def pipeline_worker(rank: int, args: argparse.Namespace) -> dict:
    """Every rank: the example's ``run_worker`` with its clocks on: step ends, schedule and compute seconds,
    returned with the run's summary."""
    recorder = stagetrace.Recorder(rank)
    clocks: dict[str, list] = {"step_ends": [], "schedule": [], "compute": [], "spans": []}  # spans: for the tests

    def end_schedule(a: float, b: float) -> None:
        clocks["schedule"].append(b - a)
        spans, recorder.spans = recorder.spans, []
        clocks["compute"].append(sum(s.end - s.start for s in spans if s.kind in stagetrace.COMPUTE))
        clocks["spans"].append([astuple(s) for s in spans])
        stagetrace.end_step()

    stagetrace.record_into(recorder)
    # the example's train(): its schedule's step timed, and each step's end: its last optimizer's step
    wrap_schedule_steps(lambda step: timed(step, end_schedule))
    stages = len(stage_indices_for(args.schedule, rank, args.world_size))  # an optimizer each
    optimizer_steps = []

    def end_step(*_) -> None:  # after the rank's last optimizer of a step
        optimizer_steps.append(time.perf_counter())
        if len(optimizer_steps) % stages == 0:
            clocks["step_ends"].append(optimizer_steps[-1])

    register_optimizer_step_post_hook(end_step)
    # run_worker's body (which saves the summary); the summary's "stage_layers": the split the run used
    # (auto: as chosen)
    env = example.init_distributed(rank, args)
    result = example.train(args, env)
    dist.destroy_process_group()
    return {**result, **clocks}


def local_worker(rank: int, args: argparse.Namespace, m: int = 1) -> dict:
    """The reference: one process, the whole model; m > 1: micro-batches one after another."""
    torch.manual_seed(args.seed)
    model = Transformer(example.model_args_from(args))
    opt = make_optimizer(args.optimizer, model.parameters(), args.lr)
    step_ends, forward_backward = [], []
    for step in range(args.steps):
        x, y = synthetic_batch(step, args.batch_size, args.seq_len, args.vocab_size, args.seed)
        start = time.perf_counter()  # what a pipeline's schedule.step spreads: zero_grad to here
        opt.zero_grad(set_to_none=True)
        for xm, ym in zip(x.chunk(m), y.chunk(m)):
            loss = tokenwise_loss_fn(model(xm), ym)
            (loss / m if m > 1 else loss).backward()
        forward_backward.append(time.perf_counter() - start)
        opt.step()
        step_ends.append(time.perf_counter())
    return {"step_ends": step_ends, "forward_backward": forward_backward,
            "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def limiting_factors(ranks: dict[int, dict], warmup: int, m: int, sequential_s: float) -> dict:
    """Efficiency = balance x overlap (docs/pipelining_transformer_benchmark.md); "compute" (sequential seconds / the
    ranks' compute) stays out of it: that reference varies by several % between runs (it once read 101 %)."""
    p = len(ranks)
    schedule = median([max(steps) for steps in zip(*(r["schedule"][warmup:] for r in ranks.values()))])
    compute = rank_compute(ranks, warmup)
    factors = {"balance": balance(compute),
               "overlap": max(compute) * (m + p - 1) / m / schedule}
    return {**factors, "binds": min(factors, key=factors.get), "schedule ms": 1e3 * schedule,
            "compute": sequential_s / sum(compute),
            "efficiency": sum(compute) * (m + p - 1) / (p * m * schedule)}


def rank_compute(ranks: dict[int, dict], warmup: int) -> list[float]:
    """Each rank's compute seconds per step (median after the warm-up)."""
    return [median(r["compute"][warmup:]) for r in ranks.values()]


def balance(compute: list[float]) -> float:
    """The mean rank's compute / the busiest rank's (1: equal stages)."""
    return sum(compute) / len(compute) / max(compute)


def step_seconds(step_ends: list[float], warmup: int) -> list[float]:
    return [b - a for a, b in zip(step_ends[warmup - 1:], step_ends[warmup:])]


def summarize(schedule: str, m: int, world_size: int, tokens: int, warmup: int,
              ranks: dict[int, dict], local: dict, local1: dict) -> dict:
    step = median([t for r in ranks.values() for t in step_seconds(r["step_ends"], warmup)])
    local_step = median(step_seconds(local["step_ends"], warmup))
    bubbles = [1 - median([c / s for c, s in zip(r["compute"][warmup:], r["schedule"][warmup:])])
               for r in ranks.values()]
    peaks = [ranks[k]["peak_mb"] for k in sorted(ranks)]
    compute = rank_compute(ranks, warmup)
    ideal = plan(schedule, world_size, m).bubble
    one_thread = median(step_seconds(local1["step_ends"], warmup))
    return {"schedule": schedule, "m": m, "step ms": 1e3 * step, "tokens/s": tokens / step,
            "local step ms": 1e3 * local_step, "local tokens/s": tokens / local_step,
            "speed-up": local_step / step,
            "1-thread step ms": 1e3 * one_thread, "x 1 thread": one_thread / step,
            # what p ranks could gain over one thread, messages free and stages equal: p (1 - ideal bubble)
            "bound": world_size * (1 - ideal),
            "bubble": sum(bubbles) / len(bubbles),
            "balance": balance(compute),
            "ideal bubble": ideal,
            "peak MB/rank": " / ".join(f"{p:.0f}" for p in peaks), "peak MB": max(peaks),
            "local peak MB": local["peak_mb"]}


def plot(path: str | None, rows: list[dict]) -> None:
    def draw(ax):
        for schedule, split in dict.fromkeys((r["schedule"], r["split flag"]) for r in rows):
            rs = [r for r in rows if (r["schedule"], r["split flag"]) == (schedule, split)]
            line, = ax.plot([r["m"] for r in rs], [r["bubble"] for r in rs], "o-", label=f"{schedule}, {split}")
            ax.plot([r["m"] for r in rs], [r["ideal bubble"] for r in rs], ":", color=line.get_color())
        ax.set_xscale("log", base=2)
        ax.set(xlabel="micro-batches m", ylabel="bubble (share of the schedule spent waiting)", ylim=(0, None),
               title="pipelining_transformer: measured bubble (solid) vs ideal (dotted)")
        ax.legend(fontsize=8)

    save_plot(path, draw)


SWEEP_HEADER = ["schedule", "split", "batch", "tokens/mb", "step ms", "tokens/s", "local step ms",
                "speed-up", "schedule ms", "bound", "efficiency", "balance", "overlap", "binds",
                "sequential ms", "compute", "bubble", "ideal bubble", "bubble/ideal", "peak MB/rank"]
# (batch size, sequence length) at m = 8: 16, 64, 128, 256, 512 tokens per micro-batch
SWEEP_POINTS = [(8, 16), (8, 64), (16, 64), (16, 128), (32, 128)]
QUICK_SWEEP_POINTS = [(8, 8), (8, 32)]


def sweep(args: argparse.Namespace, parser: argparse.ArgumentParser, model: tuple[int, ...]) -> list[dict]:
    """Speed-up and efficiency against work per micro-batch, each --stage_layers split."""
    schedules = args.schedules or ["GPipe", "1F1B"]
    m = (args.microbatches or [4 if args.quick else 8])[0]
    steps = args.steps or 3
    points = args.points or (QUICK_SWEEP_POINTS if args.quick else SWEEP_POINTS)
    p = args.world_size
    bound = p * m / (m + p - 1)
    threads = distkit.threads_per_process(p)
    dim, layers, heads, vocab = model
    jobs = []
    for batch, seq in points:
        common = ["--steps", str(steps), "--batch_size", str(batch), "--seq_len", str(seq),
                  "--dim", str(dim), "--n_layers", str(layers), "--n_heads", str(heads),
                  "--vocab_size", str(vocab), "--seed", str(args.seed), "--device", "cpu",
                  "--n_microbatches", str(m)]
        exs = []
        for label, flags in splits(args):
            for schedule in schedules:
                exs.append((label, example_args(parser, example, [*common, *flags, "--world_size", str(p),
                                                                  "--schedule", schedule])))
        local = example.build_parser().parse_args([*common, "--world_size", "1", "--threads", str(threads * p)])
        jobs.append((batch, seq, exs, local))
    print(describe_machine(p, threads))
    print(f"# sweep: {', '.join(schedules)} on {p} ranks, m = {m}, splits: "
          f"{', '.join(label for label, _ in splits(args))}; model dim {dim}, {layers} layers, "
          f"{heads} heads, vocabulary {vocab}; {steps} AdamW steps, {args.warmup} untimed")
    print(f"# local: the whole batch in one process, {threads * p} thread(s); sequential: its {m} "
          f"micro-batches one after another, 1 thread; bound on the speed-up over sequential: "
          f"p m / (m + p - 1) = {bound:.3f}")
    rows = []
    for batch, seq, exs, local_args in jobs:
        local = distkit.launch(local_worker, local_args)[0]
        sequential = distkit.launch(functools.partial(local_worker, m=m),
                                    argparse.Namespace(**{**vars(local_args), "threads": 1}))[0]
        seq_fb = median(sequential["forward_backward"][args.warmup:])
        for label, ex in exs:
            if not args.steps:  # small points are cheap and noisy: time at least ~6 s of steps
                ex.steps = min(12, max(3, args.warmup + math.ceil(6 / (seq_fb / p))))
            ranks = distkit.launch(pipeline_worker, ex)
            row = summarize(ex.schedule, m, p, batch * seq, args.warmup, ranks, local, local)
            rows.append({**{k: row[k] for k in ("schedule", "m", "step ms", "tokens/s", "local step ms",
                                                "speed-up", "bubble", "ideal bubble", "peak MB/rank",
                                                "peak MB")},
                         "split": split_label(label, ranks), "split flag": label,
                         "batch": f"{batch}x{seq}", "tokens/mb": batch * seq // m,
                         "sequential ms": 1e3 * seq_fb, "bound": bound,
                         **limiting_factors(ranks, args.warmup, m, seq_fb),
                         "bubble/ideal": row["bubble"] / row["ideal bubble"]})
    print(format_table(SWEEP_HEADER, rows))
    for r in rows:
        if r["efficiency"] > 1:
            print(f"# MEASUREMENT ERROR: {r['schedule']} ({r['split']}) at {r['batch']} is at "
                  f"{r['efficiency'] * bound:.2f}x its compute, above the bound {bound:.2f}x")
    heaviest = rows[-1]["batch"]
    for label, _ in splits(args):
        for schedule in schedules:
            rs = [r for r in rows if r["schedule"] == schedule and r["split flag"] == label]
            wins = [r for r in rs if r["speed-up"] >= 1]
            print(f"# crossover, {schedule}, {label}: " + (
                f"{wins[0]['tokens/mb']} tokens per micro-batch is the least work measured at which "
                f"{p} ranks beat one process ({wins[0]['speed-up']:.2f}x)" if wins else
                "none measured: one process was faster at every point"))
            heavy = rs[-1]
            print(f"# {schedule}, {heavy['split']}, at {heaviest} (the most work): "
                  f"{100 * heavy['efficiency']:.0f} % of the bound (balance "
                  f"{heavy['balance']:.2f} x overlap {heavy['overlap']:.2f}, {heavy['binds']} binds; "
                  f"the ranks computed at {heavy['compute']:.2f}x one process's speed), bubble "
                  f"{heavy['bubble']:.3f} against the ideal {heavy['ideal bubble']:.3f} "
                  f"({100 * (heavy['bubble/ideal'] - 1):+.0f} %), "
                  f"peak MB per rank {heavy['peak MB/rank']}")
    compare_splits(rows, "auto", "even")
    plot_sweep(args.plot, rows)
    return rows


def compare_splits(rows: list[dict], new: str, old: str) -> None:
    """One line: is split ``new`` at least as fast as ``old`` at every point and schedule?"""
    pairs = [(a, b) for a in rows for b in rows if a["split flag"] == new and b["split flag"] == old
             and (a["schedule"], a["batch"]) == (b["schedule"], b["batch"])]
    if not pairs:
        return
    ratios = [b["step ms"] / a["step ms"] for a, b in pairs]
    slower = [f"{a['schedule']} at {a['batch']} ({r:.2f}x)" for (a, _), r in zip(pairs, ratios) if r < 1]
    print(f"# {new} against {old}: {min(ratios):.2f}x to {max(ratios):.2f}x as fast; "
          + (f"slower at {', '.join(slower)}" if slower else "never slower"))


def plot_sweep(path: str | None, rows: list[dict]) -> None:
    def draw(axes):
        a, b = axes
        for schedule, split in dict.fromkeys((r["schedule"], r["split flag"]) for r in rows):
            rs = [r for r in rows if (r["schedule"], r["split flag"]) == (schedule, split)]
            x = [r["tokens/mb"] for r in rs]
            a.plot(x, [r["speed-up"] for r in rs], "o-", label=f"{schedule}, {split}")
            b.plot(x, [100 * r["efficiency"] for r in rs], "o-", label=f"{schedule}, {split}")
        a.axhline(1, color="0.5", ls=":", label="one process (all cores)")
        a.set_ylabel("speed-up over one process, whole batch, all cores")
        b.axhline(100, color="k", lw=0.8, label=f"bound p m/(m+p-1) = {rows[0]['bound']:.2f}x")
        b.set(ylabel="efficiency: speed-up over sequential / bound (%)", ylim=(0, 110))
        for ax in (a, b):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("work per micro-batch (tokens)")
            ax.legend(fontsize=8)
        a.figure.suptitle(f"pipelining_transformer on {len(rows) and 2} ranks, m = {rows[0]['m']}: "
                          "where pipelining pays", fontsize=10)

    save_plot(path, draw, ncols=2, figsize=(11, 4.2))


def splits(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """Each split as (label, the example's flags): even, auto, or counts (5,3; 5 3 alone: one)."""
    specs = args.stage_layers or ["even"]
    if all(_is_number(t) for t in specs):  # --stage_layers 5 3: the example's own form
        specs = [",".join(specs)]
    return [("even", []) if spec == "even" else (spec.replace(",", " "), ["--stage_layers", *spec.split(",")])
            for spec in specs]


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def split_spec(text: str) -> str:
    """One --stage_layers value: even, auto, or counts joined by commas (the example's ``layer_count``)."""
    if text in ("even", "auto"):
        return text
    if "," not in text and not _is_number(text) or "auto" in text.split(","):
        raise argparse.ArgumentTypeError(
            f"a split is even, auto or layer counts per stage joined by commas (5,3 or 4.5,3.5), "
            f"got {text!r}")
    for count in text.split(","):
        layer_count(count)  # its one line if not a count
    return text


def split_label(label: str, ranks: dict[int, dict]) -> str:
    """``auto`` with what it chose on the ranks: ``auto: 4.5 3.5``."""
    chosen = ranks[0].get("stage_layers")
    return f"auto: {' '.join(f'{n:g}' for n in chosen)}" if label == "auto" and chosen else label


def point(text: str) -> tuple[int, int]:
    try:
        batch, seq = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a point is BATCHxSEQ (like 16x128), got {text!r}")
    if batch < 1 or seq < 1:
        raise argparse.ArgumentTypeError(f"a point needs a positive batch and length, got {text!r}")
    return batch, seq


def build_parser() -> argparse.ArgumentParser:
    p = bench_parser(__doc__, "measured vs ideal bubble (or the sweep)")
    p.add_argument("--schedules", nargs="+", type=example.schedule_name, default=None, metavar="NAME",
                   help=f"default: all ({', '.join(SCHEDULES)}); quick: {' '.join(QUICK_SCHEDULES)}")
    p.add_argument("--microbatches", type=int, nargs="+", default=None, metavar="M",
                   help="micro-batch counts (default 2 4 8; quick 2 4)")
    p.add_argument("--world_size", type=int, default=2, help="ranks (pipeline width p)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 8; quick 4)")
    p.add_argument("--warmup", type=int, default=1, help="steps dropped before timing")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--seq_len", type=int, default=16)
    p.add_argument("--model", nargs=4, type=int, default=None, metavar=("DIM", "LAYERS", "HEADS", "VOCAB"),
                   help="model sizes (default: the tutorial's 512 8 8 10000; quick 256 8 8 10000)")
    p.add_argument("--stage_layers", nargs="+", type=split_spec, default=None, metavar="SPLIT",
                   help="the splits to run side by side: even, auto (balance.py), or counts per "
                        "stage joined by commas (5,3 or 4.5,3.5); '--stage_layers 5 3' alone is "
                        "the example's form, one split (default: even)")
    p.add_argument("--sweep", action="store_true",
                   help="speed-up and efficiency against work per micro-batch (GPipe, 1F1B; m = 8)")
    p.add_argument("--points", nargs="+", type=point, default=None, metavar="BATCHxSEQ",
                   help="sweep points (default " + " ".join(f"{b}x{t}" for b, t in SWEEP_POINTS)
                        + "; quick " + " ".join(f"{b}x{t}" for b, t in QUICK_SWEEP_POINTS) + ")")
    return p


def main(argv: list[str] | None = None) -> list[dict]:
    parser = build_parser()
    args = parse(parser, argv)
    schedules = args.schedules or (QUICK_SCHEDULES if args.quick else list(SCHEDULES))
    microbatches = args.microbatches or ([2, 4] if args.quick else [2, 4, 8])
    steps = args.steps if args.steps is not None else (4 if args.quick else 8)
    # under this script's flag names (the example's check_args would name its own)
    check_at_least(parser, 1, {"--microbatches": microbatches, "--world_size": args.world_size,
                               "--steps": steps, "--warmup": args.warmup, "--batch_size": args.batch_size,
                               "--seq_len": args.seq_len, "--model": args.model})
    if steps < args.warmup + 2:
        parser.error("--warmup must be at least 1 and --steps at least --warmup + 2")
    if args.points and not args.sweep:
        parser.error("--points needs --sweep")
    if args.sweep and args.microbatches and len(args.microbatches) > 1:
        parser.error(f"--sweep takes one --microbatches value, got {len(args.microbatches)}")
    dim, layers, heads, vocab = args.model or ((256, 8, 8, 10000) if args.quick else (512, 8, 8, 10000))
    if args.sweep:
        return sweep(args, parser, (dim, layers, heads, vocab))
    common = ["--steps", str(steps), "--batch_size", str(args.batch_size), "--seq_len", str(args.seq_len),
              "--dim", str(dim), "--n_layers", str(layers), "--n_heads", str(heads),
              "--vocab_size", str(vocab), "--seed", str(args.seed), "--device", "cpu"]
    jobs, skipped = [], []
    for label, flags in splits(args):
        for schedule in schedules:
            for m in microbatches:
                problem = schedule_problem(schedule, args.world_size, m)
                counts = flags[1:] if flags[1:] != ["auto"] else []
                n_stages = num_stages_for(schedule, args.world_size)
                if counts and len(counts) != n_stages:
                    problem = f"{len(counts)} counts for {n_stages} stages"
                if n_stages > layers:  # e.g. Interleaved1F1B on 5 ranks: 10 stages, 8 layers
                    problem = f"{n_stages} stages for {layers} layers"
                if problem and len(schedules) * len(microbatches) > 1:
                    skipped.append((label, schedule, m, problem))
                    continue  # e.g. DualPipeV with fewer micro-batches than stages
                ex = example_args(parser, example, [*common, *flags, "--world_size", str(args.world_size),
                                                    "--schedule", schedule, "--n_microbatches", str(m)])
                jobs.append((label, schedule, m, ex))
    # a named split, schedule or m that runs nowhere is a mistake, not a skip
    named = [("--stage_layers", 0, [label for label, _ in splits(args)] if args.stage_layers else [])]
    named += [("--schedules", 1, schedules if args.schedules else []),
              ("--microbatches", 2, microbatches if args.microbatches else [])]
    for flag, i, values in named:
        for value in values:
            if not any(job[i] == value for job in jobs):
                why = next(s[3] for s in skipped if s[i] == value)
                parser.error(f"{flag} {value} runs in none of the configurations ({why})")
    if not jobs:  # nothing named, and every default skipped: an empty table would exit 0
        parser.error(f"--world_size {args.world_size} runs none of the configurations "
                     f"({'; '.join(sorted({s[3] for s in skipped}))})")
    threads = distkit.threads_per_process(args.world_size)
    local_args = example.build_parser().parse_args(
        [*common, "--world_size", "1", "--threads", str(threads * args.world_size)])

    print(describe_machine(args.world_size, threads))
    print(f"# local: one process, the whole model, {threads * args.world_size} thread(s) "
          f"(1-thread: the same with one)")
    print(f"# model dim {dim}, {layers} layers, {heads} heads, vocabulary {vocab}; batches of "
          f"{args.batch_size} x {args.seq_len} tokens; {steps} AdamW steps, {args.warmup} untimed; "
          f"splits: {', '.join(label for label, _ in splits(args))}")
    for label, schedule, m, problem in skipped:
        print(f"# skipped {schedule} m={m} ({label}): {problem}")
    local = distkit.launch(local_worker, local_args)[0]
    # one thread too: on a busy machine a second thread waits for a core at every parallel region
    local1 = distkit.launch(local_worker, argparse.Namespace(**{**vars(local_args), "threads": 1}))[0]
    rows = []
    for label, schedule, m, ex in jobs:
        ranks = distkit.launch(pipeline_worker, ex)
        rows.append({**summarize(schedule, m, args.world_size, args.batch_size * args.seq_len,
                                 args.warmup, ranks, local, local1),
                     "split": split_label(label, ranks), "split flag": label})
    print(format_table(HEADER, rows))
    plot(args.plot, rows)
    assert all(math.isfinite(r[k]) for r in rows for k in HEADER
               if k not in ("schedule", "split", "peak MB/rank"))
    return rows


if __name__ == "__main__":
    main()
