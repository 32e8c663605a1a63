"""The agent's run beyond the tutorial, met by ``run_worker`` through one ``AgentRun``, twice: ``build_agent``
(the seed, --batch, --reward_threshold, and a record of each episode's reward) and ``finish`` (--save, the
result)."""
from __future__ import annotations

import argparse
import logging
from typing import Any, Callable

import torch

from rpc_rl.agent import Agent
from rpc_rl.batched import BatchAgent
from rpc_rl.play import save_policy

log = logging.getLogger(__name__)


class AgentRun:
    """The agent's extras, one call per phase: ``build_agent`` (start), ``finish`` (end)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rewards: list[float] = []  # finish_episode's result, per episode

    def build_agent(self, world_size: int) -> Agent:
        """The tutorial's ``Agent(world_size)``, seeded, with the flags applied and recorded."""
        # its seed (actions, dropout) fixes the run: fully with one observer (several interleave their RPCs)
        torch.manual_seed(self.args.seed)
        agent = (BatchAgent if self.args.batch else Agent)(world_size, self.args.gamma, self.args.seed)
        if self.args.reward_threshold is not None:
            agent.reward_threshold = self.args.reward_threshold
        # wrapped on this instance (the class is untouched): run_worker's loop stays the tutorial's
        agent.finish_episode = self._recorded(agent.finish_episode)
        return agent

    def _recorded(self, finish_episode: Callable[[], Any]) -> Callable[[], Any]:
        def recorded() -> Any:
            self.rewards.append(finish_episode())
            return self.rewards[-1]
        return recorded

    def finish(self, agent: Agent) -> dict:
        """Save the policy (``--save``); what ``run_worker`` returns for the agent."""
        episodes = len(self.rewards)
        if self.args.save:
            save_policy(agent.policy, self.args.save, episodes=episodes, running_reward=agent.running_reward)
            log.info(f"Policy saved to {self.args.save}")
        return {"solved": agent.running_reward > agent.reward_threshold, "episodes": episodes,
                "rewards": self.rewards, "running_reward": agent.running_reward,
                "threshold": agent.reward_threshold, "policy": agent.policy.state_dict()}
