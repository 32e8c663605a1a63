"""Benchmark rpc_rl: RPC round trip, environment steps/s (tutorial vs --batch), episodes to solve.

The tutorial's observer makes two RPCs per environment step, so it steps at most 1 / (2 x
round trip) times a second (--batch: one RPC); the table puts each rate beside that bound. Usage: docs/rpc_rl.md.
"""
from __future__ import annotations

import argparse
import itertools
import math
import time

from benchlib import bench_parser, check_at_least, describe_machine, example_args, format_table, parse, save_plot
import distkit
import rpc_rl.main as rl_main
from rpc_phases import rpc_round_trip, saved_by


def timed_worker(rank: int, args: argparse.Namespace) -> dict | None:
    """``run_worker``; the agent's saved run gains the environment steps and seconds of its episodes."""
    count = {"env_steps": 0, "seconds": 0.0}
    build = rl_main.build_agent

    def timed(method):
        def wrapper():
            start = time.perf_counter()
            result = method()
            count["seconds"] += time.perf_counter() - start
            count["env_steps"] += sum(result.values()) if isinstance(result, dict) else 0  # run_episode's
            return result
        return wrapper

    def build_agent(run_args: argparse.Namespace, world_size: int):  # the agent's episodes timed
        agent = build(run_args, world_size)
        agent.run_episode, agent.finish_episode = timed(agent.run_episode), timed(agent.finish_episode)
        return agent

    rl_main.build_agent = build_agent  # in this rank's process only
    result = saved_by(rl_main.run_worker, rank, args)  # the agent's run; an observer's: None
    return {**result, **count} if result else result


def rl_args(parser: argparse.ArgumentParser, world_size: int, batch: bool, max_episodes: int,
            threshold: float, seed: int) -> argparse.Namespace:
    """One run's flags, checked by the example's own ``check_args`` (one line under ``parser``)."""
    argv = ["--world_size", str(world_size), "--max_episodes", str(max_episodes),
            "--reward_threshold", str(threshold), "--log_interval", str(10**6), "--seed", str(seed)]
    return example_args(parser, rl_main, argv + (["--batch"] if batch else []))


def build_parser() -> argparse.ArgumentParser:
    p = bench_parser(__doc__, "the running-reward curves", seed=1)
    p.add_argument("--world_sizes", type=int, nargs="+", default=None,
                   help="processes per run: 1 agent + observers (default 2 3 5; quick 2 5)")
    p.add_argument("--speed_episodes", type=int, default=None, help="episodes per speed run (default 30; quick 8)")
    p.add_argument("--solve_sizes", type=int, nargs="*", default=None,
                   help="world sizes to train until solved (default 2 3 5; quick 3)")
    p.add_argument("--threshold", type=float, default=None, help="solved at this running reward (default 475; quick 100)")
    p.add_argument("--max_episodes", type=int, default=1000, help="give up a solve run here")
    p.add_argument("--rtt_calls", type=int, default=500, help="timed RPC round trips")
    p.add_argument("--only", choices=["speed", "solve"], default=None,
                   help="run only the speed runs or only the solve runs (default: both)")
    return p


def main(argv: list[str] | None = None) -> list[dict]:
    parser = build_parser()
    args = parse(parser, argv)
    q = args.quick
    sizes = args.world_sizes or ([2, 5] if q else [2, 3, 5])
    speed_episodes = args.speed_episodes if args.speed_episodes is not None else (8 if q else 30)
    solve_sizes = args.solve_sizes if args.solve_sizes is not None else ([3] if q else [2, 3, 5])
    threshold = args.threshold if args.threshold is not None else (100.0 if q else 475.0)
    check_at_least(parser, 2, {"--world_sizes": sizes, "--solve_sizes": solve_sizes})
    check_at_least(parser, 1, {"--speed_episodes": speed_episodes, "--max_episodes": args.max_episodes,
                               "--rtt_calls": args.rtt_calls})
    if not 0 < threshold <= 500:  # the example's --reward_threshold range; false for nan too
        parser.error(f"--threshold must be in (0, 500], got {threshold}")
    if args.only == "solve" and not solve_sizes:  # nothing would run
        parser.error("--only solve needs --solve_sizes")
    sizes = [] if args.only == "solve" else sizes  # --only: the other table's runs are left out
    solve_sizes = [] if args.only == "speed" else solve_sizes
    # every run's flags first (speed runs: threshold 500, never "solved", so each runs all its episodes)
    speed_runs = [(ws, batch, rl_args(parser, ws, batch, speed_episodes, 500.0, args.seed))
                  for ws in sizes for batch in (False, True)]
    solve_runs = [(ws, batch, rl_args(parser, ws, batch, args.max_episodes, threshold, args.seed))
                  for ws in solve_sizes for batch in (False, True)]
    print(describe_machine(max(sizes + solve_sizes)))

    rtt = rpc_round_trip(args.rtt_calls, end="")
    print(f" -> at most {1 / (2 * rtt):.0f} steps/s per observer with 2 RPCs a step, {1 / rtt:.0f} with 1\n")

    rows, base = [], None
    for ws, batch, run_args in speed_runs:
        r = distkit.launch(timed_worker, run_args)[0]
        rate = r["env_steps"] / r["seconds"]
        base = rate if not batch else base  # the tutorial's rate at this world size
        bound = (ws - 1) / ((1 if batch else 2) * rtt)
        rows.append({"table": "speed", "world_size": ws, "observers": ws - 1,
                     "mode": "batch" if batch else "tutorial", "episodes": r["episodes"],
                     "env_steps": r["env_steps"], "steps/s": rate, "speed-up": rate / base,
                     "rpc bound steps/s": bound, "of bound": rate / bound})
    if rows:
        print(format_table(["world_size", "observers", "mode", "episodes", "env_steps", "steps/s",
                            "speed-up", "rpc bound steps/s", "of bound"], rows))

    curves, solve_rows = {}, []
    for ws, batch, run_args in solve_runs:
        r = distkit.launch(timed_worker, run_args)[0]
        mode = "batch" if batch else "tutorial"
        # the agent's running reward after each episode (0.05 of each episode's minimum)
        curves[f"{ws - 1} obs, {mode}"] = list(itertools.accumulate(
            r["rewards"], lambda run, m: 0.05 * m + 0.95 * run, initial=0.0))[1:]
        solve_rows.append({"table": "solve", "world_size": ws, "observers": ws - 1, "mode": mode,
                           "solved": r["solved"], "episodes": r["episodes"],
                           "seconds": r["seconds"], "steps/s": r["env_steps"] / r["seconds"]})
    if solve_rows:
        print(f"\n# training until the running reward passes {threshold:g} "
              f"(at most {args.max_episodes} episodes)")
        print(format_table(["world_size", "mode", "solved", "episodes", "seconds", "steps/s"], solve_rows))

    def draw(ax):
        for label, curve in curves.items():
            ax.plot(range(1, len(curve) + 1), curve, label=label)
        ax.axhline(threshold, color="grey", linestyle=":", label=f"threshold {threshold:g}")
        ax.set(xlabel="episode", ylabel="running reward", title="rpc_rl: CartPole-v1 running reward")
        ax.legend()

    save_plot(args.plot, draw)
    all_rows = rows + solve_rows
    assert all(math.isfinite(r["steps/s"]) for r in all_rows)
    return all_rows


if __name__ == "__main__":
    main()
