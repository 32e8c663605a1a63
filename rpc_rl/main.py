"""Distributed REINFORCE on CartPole-v1 with RPC and RRef ("Getting Started with Distributed RPC
Framework", first half): rank 0 is the agent (rpc_rl/agent.py), ranks 1..N-1 observers. It stops at
"Solved!" (running reward past CartPole's 475) or after --max_episodes, exit status 1.

    python rpc_rl/main.py --world_size 3        # mp.spawn starts the processes
    torchrun --nproc_per_node 3 rpc_rl/main.py  # or torchrun does, one rank each
    python rpc_rl/main.py --world_size 3 --save policy.pt && python rpc_rl/main.py --play policy.pt
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
from torch.distributed.elastic.multiprocessing.errors import record

import distkit
from distkit.args import at_least, path, up_to
from rpc_rl.agent import AGENT_NAME, OBSERVER_NAME, Agent
from rpc_rl.play import load_policy, play, save_policy

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    parser = distkit.ArgumentParser(description="RPC Reinforcement Learning Example")
    parser.add_argument("--log_interval", type=at_least(1), default=10, metavar="N",
                        help="interval between training status logs")
    parser.add_argument("--gamma", type=up_to(1), default=0.99, metavar="G",
                        help="how much to value future rewards")
    parser.add_argument("--seed", type=at_least(0), default=1, metavar="S",  # observers seed numpy: >= 0
                        help="random seed for reproducibility")
    parser.add_argument("--max_episodes", type=at_least(1), default=1000, metavar="E",
                        help="give up (exit status 1) after this many episodes")
    parser.add_argument("--reward_threshold", type=up_to(500), default=None, metavar="R",
                        help="stop once the running reward passes R (default: CartPole-v1's 475)")
    parser.add_argument("--batch", action="store_true",
                        help="one RPC per step and one batched policy forward for all observers "
                             "(rpc_rl/batched.py) instead of the tutorial's two RPCs per step")
    parser.add_argument("--save", type=path("out_file"), metavar="PATH",
                        help="write the trained policy here when training ends")
    parser.add_argument("--play", type=path("in_file"), default=None, metavar="PATH",
                        help="load a saved policy and play --play_episodes episodes here, no RPC")
    parser.add_argument("--play_episodes", type=at_least(1), default=5, metavar="N",
                        help="episodes to play with --play")
    distkit.add_launch_args(parser, world_size=2, rpc_timeout=60, device=False, hang_timeout=60)
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    # every rank on the CPU (no --device flag): a 4-input policy fed one state at a time gains nothing
    # from a GPU, and the observers' environments run on the CPU anyway
    distkit.check_launch_args(parser, args, min_world_size=2)


def build_agent(args: argparse.Namespace, world_size: int) -> Agent:
    """The tutorial's ``Agent(world_size)``, seeded; with --batch the batched one (loaded only then)."""
    # its seed (actions, dropout) fixes the run: fully with one observer (several interleave their RPCs)
    torch.manual_seed(args.seed)
    if args.batch:
        from rpc_rl.batched import BatchAgent
        agent = BatchAgent(world_size, args.gamma, args.seed)
    else:
        agent = Agent(world_size, args.gamma, args.seed)
    if args.reward_threshold is not None:
        agent.reward_threshold = args.reward_threshold
    return agent


def finish_run(agent: Agent, rewards: list[float], args: argparse.Namespace) -> dict:
    """After the agent's loop: its run (for ``main`` and the tests), and the policy saved with --save."""
    if args.save:
        save_policy(agent.policy, args.save, episodes=len(rewards), running_reward=agent.running_reward)
        log.info(f"Policy saved to {args.save}")
    return {"solved": agent.running_reward > agent.reward_threshold, "episodes": len(rewards), "rewards": rewards,
            "running_reward": agent.running_reward, "threshold": agent.reward_threshold,
            "policy": agent.policy.state_dict()}


def run_worker(rank: int, args: argparse.Namespace) -> None:
    """Rank 0 trains as the agent; other ranks serve as observers. The agent leaves its run for main()."""
    distkit.start_rank(rank, args)  # beyond the tutorial: log prefix, threads, hang bound (distkit/rank.py)
    world_size = args.world_size
    # TCP only (as between machines): TensorPipe's shared-memory transport busy-polls, too costly on a small CPU
    options = rpc.TensorPipeRpcBackendOptions(rpc_timeout=args.rpc_timeout, _transports=["uv"])
    if rank == 0:
        # rank 0 is the agent
        rpc.init_rpc(AGENT_NAME, rank=rank, world_size=world_size, rpc_backend_options=options)
        agent = build_agent(args, world_size)
        rewards = []  # each episode's, for the result
        log.info(f"This will run until reward threshold of {agent.reward_threshold} is reached "
                 f"or {args.max_episodes} episodes have run.")
        for i_episode in range(1, args.max_episodes + 1):
            agent.run_episode()
            last_reward = agent.finish_episode()
            rewards.append(last_reward)

            if i_episode % args.log_interval == 0:
                log.info(f"Episode {i_episode}\tLast reward: {last_reward:.2f}\tAverage reward: "
                         f"{agent.running_reward:.2f}")
            if agent.running_reward > agent.reward_threshold:
                log.info(f"Solved! Running reward is now {agent.running_reward}!")
                break
        distkit.save_result(rank, finish_run(agent, rewards, args))  # beyond the tutorial: for main(), --save
    else:
        # other ranks are the observers
        rpc.init_rpc(OBSERVER_NAME.format(rank), rank=rank, world_size=world_size, rpc_backend_options=options)
        # observers passively wait for the agent's instructions (bounded: each answer of the agent's counts)
        distkit.wait_on(AGENT_NAME, timeout=args.rpc_timeout)
    # block until all rpcs finish (every outstanding RPC of the job), and shut RPC down
    rpc.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    if args.play:
        try:
            policy = load_policy(args.play)
        except ValueError as e:
            parser.error(str(e))
        for i, reward in enumerate(play(policy, args.play_episodes, args.seed), 1):
            print(f"Episode {i}\tReward: {reward:.0f}")
        return 0
    if distkit.under_torchrun():  # torchrun started this process as one rank: run it
        record(run_worker)(int(os.environ["RANK"]), args)
    else:
        distkit.prepare_spawn()  # beyond the tutorial: a free port, a folder for the agent's run
        mp.spawn(run_worker, args=(args,), nprocs=args.world_size, join=True)
    agent = distkit.results().get(0)
    if agent is not None and not agent["solved"]:
        print(f"Not solved: running reward {agent['running_reward']:.2f} is below {agent['threshold']} after "
              f"{agent['episodes']} episodes (raise --max_episodes)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
