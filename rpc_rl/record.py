"""What a run records beside the tutorial's training loop, for the benchmark and the tests:
each episode's reward, the environment steps of all observers, the seconds spent.

``EpisodeRecord.attach(agent)`` wraps that one agent's ``run_episode`` and ``finish_episode``,
so ``run_worker``'s loop stays the tutorial's two calls (``agent.run_episode()``,
``last_reward = agent.finish_episode()``) and the counting happens outside it.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

from rpc_rl.agent import Agent


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
