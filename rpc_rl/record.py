"""What the agent's run does beyond the tutorial, entering ``run_worker`` through ``AgentRun``:
one call to build the agent, one to end the run.

``AgentRun.build_agent`` seeds torch, builds the ``Agent`` (or, with ``--batch``, the
``BatchAgent``), applies ``--reward_threshold`` and attaches an ``EpisodeRecord``: each
episode's reward, the environment steps of all observers, the seconds spent, for the
benchmark and the tests. ``EpisodeRecord.attach(agent)`` wraps that one agent's
``run_episode`` and ``finish_episode``, so ``run_worker``'s loop stays the tutorial's two
calls (``agent.run_episode()``, ``last_reward = agent.finish_episode()``) and the counting
happens outside it. ``AgentRun.finish`` saves the policy (``--save``) and returns the result.
"""
from __future__ import annotations

import argparse
import functools
import logging
import time
from dataclasses import dataclass, field

import torch

from rpc_rl.agent import Agent
from rpc_rl.batched import BatchAgent
from rpc_rl.play import save_policy

log = logging.getLogger(__name__)


@dataclass
class EpisodeRecord:
    """Filled in by the wrapped methods of the agent it is attached to."""

    rewards: list[float] = field(default_factory=list)  # finish_episode's result, per episode
    env_steps: int = 0  # environment steps, all observers and episodes together
    seconds: float = 0.0  # time spent inside run_episode and finish_episode

    @classmethod
    def attach(cls, agent: Agent) -> EpisodeRecord:
        """Wrap ``agent``'s two episode methods (on the instance: the class is untouched)."""
        record = cls()
        run_episode, finish_episode = agent.run_episode, agent.finish_episode

        @functools.wraps(run_episode)
        def recorded_run_episode() -> dict[int, int]:
            start = time.perf_counter()
            steps = run_episode()
            record.seconds += time.perf_counter() - start
            record.env_steps += sum(steps.values())
            return steps

        @functools.wraps(finish_episode)
        def recorded_finish_episode() -> float:
            start = time.perf_counter()
            last_reward = finish_episode()
            record.seconds += time.perf_counter() - start
            record.rewards.append(last_reward)
            return last_reward

        agent.run_episode, agent.finish_episode = recorded_run_episode, recorded_finish_episode
        return record


class AgentRun:
    """The agent's extras, one call per phase: ``build_agent`` (start), ``finish`` (end)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.record = EpisodeRecord()

    def build_agent(self, world_size: int) -> Agent:
        """The tutorial's ``Agent(world_size)``, seeded, with the flags applied and recorded."""
        args = self.args
        # the agent samples every action and applies dropout, so its seed fixes the run
        # (fully so with one observer; several observers' RPCs interleave in any order)
        torch.manual_seed(args.seed)
        agent = (BatchAgent if args.batch else Agent)(world_size, args.gamma, args.seed)
        if args.reward_threshold is not None:
            agent.reward_threshold = args.reward_threshold
        # rewards, environment steps and seconds, counted outside the loop
        self.record = EpisodeRecord.attach(agent)
        return agent

    def finish(self, agent: Agent) -> dict:
        """Save the policy (``--save``); what ``run_worker`` returns for the agent."""
        record = self.record
        if self.args.save:
            save_policy(agent.policy, self.args.save, episodes=len(record.rewards),
                        running_reward=agent.running_reward)
            log.info(f"Policy saved to {self.args.save}")
        return {"solved": agent.running_reward > agent.reward_threshold,
                "episodes": len(record.rewards), "rewards": record.rewards,
                "running_reward": agent.running_reward, "threshold": agent.reward_threshold,
                "env_steps": record.env_steps, "seconds": record.seconds,
                "policy": agent.policy.state_dict()}
