"""The last stage's step time and peak memory with and without merging the outputs (return_outputs).

pipelining_transformer's last stage calls ``schedule.step(target=y, losses=losses, return_outputs=False)``:
with the default ``True`` the stage keeps every micro-batch's logits (batch x seq x vocab floats) and
merges them into one tensor that ``train`` never reads. This runs the example's own ``train`` on
2 ranks both ways, at the README's sizes and at a larger vocabulary, alternating the two, and prints
the last stage's median step time and its process's peak resident memory::

    .venv/bin/python scripts/bench_return_outputs.py             # vocab 10000 and 100000, 3 runs each
    .venv/bin/python scripts/bench_return_outputs.py --quick     # vocab 1000 and 10000, 1 run each
"""
from __future__ import annotations

import argparse
import functools
import resource
import time

import torch.distributed as dist

from benchlib import check_at_least, wrap_schedule_steps, describe_machine, example_args, format_table, median
import distkit
import pipelining_transformer.train as example

HEADER = ["vocab", "return_outputs", "last stage step ms", "peak MB (last stage)", "runs"]


def worker(return_outputs: bool, rank: int, args: argparse.Namespace) -> dict:
    """The example's ``run_worker``, each ``schedule.step`` given ``return_outputs`` and timed."""
    seconds: list[float] = []

    def forced(step):
        @functools.wraps(step)
        def wrapper(self, *a, **kw):
            start = time.perf_counter()
            try:
                return step(self, *a, **{**kw, "return_outputs": return_outputs})
            finally:
                seconds.append(time.perf_counter() - start)
        return wrapper

    wrap_schedule_steps(forced)
    env = example.init_distributed(rank, args)  # run_worker's body (which saves the summary)
    result = example.train(args, env)
    dist.destroy_process_group()
    return {"last": rank == args.world_size - 1, "step_s": seconds[args.warmup:],
            "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "losses": result["losses"]}


def build_parser() -> argparse.ArgumentParser:
    p = distkit.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="vocab 1000 and 10000, one run each")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocabs", type=int, nargs="+", default=None, help="vocabulary sizes (default: 10000 100000)")
    p.add_argument("--runs", type=int, default=None, help="runs of each setting (default: 3; --quick 1)")
    p.add_argument("--steps", type=int, default=6, help="steps a run")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the median (at least 1)")
    return p


def main(argv: list[str] | None = None) -> list[dict]:
    parser = build_parser()
    args = parser.parse_args(argv)
    vocabs = args.vocabs if args.vocabs is not None else [1000, 10000] if args.quick else [10000, 100000]
    runs = args.runs if args.runs is not None else 1 if args.quick else 3
    check_at_least(parser, 1, {"--runs": runs, "--steps": args.steps, "--vocabs": vocabs,
                               "--warmup": args.warmup})  # the first step builds the schedule's state
    check_at_least(parser, 0, {"--seed": args.seed})
    if args.steps <= args.warmup:
        parser.error("--steps must be more than --warmup")
    print(describe_machine(2))
    rows = []
    for vocab in vocabs:
        ex = example_args(parser, example, ["--world_size", "2", "--vocab_size", str(vocab),
                                            "--steps", str(args.steps), "--seed", str(args.seed)])
        ex.warmup = args.warmup
        seen: dict[bool, list[dict]] = {True: [], False: []}
        for i in range(runs):
            for flag in (True, False) if i % 2 == 0 else (False, True):  # alternated: load drifts
                ranks = distkit.launch(functools.partial(worker, flag), ex)
                seen[flag].append(next(r for r in ranks.values() if r["last"]))
        assert seen[True][0]["losses"] == seen[False][0]["losses"], "the outputs changed the training"
        for flag, last in seen.items():
            rows.append({"vocab": vocab, "return_outputs": flag, "runs": runs,
                         "last stage step ms": 1e3 * median([t for r in last for t in r["step_s"]]),
                         "peak MB (last stage)": median([r["peak_mb"] for r in last])})
    print(format_table(HEADER, rows))
    return rows


if __name__ == "__main__":
    main()
