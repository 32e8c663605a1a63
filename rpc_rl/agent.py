"""The tutorial's ``Policy``, ``Observer`` and ``Agent``: the agent (rank 0) owns the policy and learns;
each observer (every other rank) owns a CartPole environment and asks the agent for every action over RPC."""
from __future__ import annotations

import gymnasium as gym
import numpy as np
import torch
import torch.distributed.rpc as rpc
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.distributed.rpc import RRef, remote
from torch.distributions import Categorical

import distkit

AGENT_NAME = "agent"
OBSERVER_NAME = "obs{}"
ENV_NAME = "CartPole-v1"


class Policy(nn.Module):
    """Maps a CartPole state (4 numbers) to the probabilities of pushing left or right."""

    def __init__(self) -> None:
        super().__init__()
        self.affine1 = nn.Linear(4, 128)
        self.dropout = nn.Dropout(p=0.6)
        self.affine2 = nn.Linear(128, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.affine1(x)
        x = self.dropout(x)
        x = F.relu(x)
        action_scores = self.affine2(x)
        return F.softmax(action_scores, dim=1)


class Observer:
    """Made on an observer rank by the agent (``rpc.remote``); each step is two RPCs back to it."""

    def __init__(self, seed: int) -> None:
        self.id = rpc.get_worker_info().id
        self.env = gym.make(ENV_NAME)
        # gymnasium seeds through reset(): only the first reset takes it, later ones continue its stream
        self.seed: int | None = seed

    def run_episode(self, agent_rref: RRef) -> int:
        """Play one episode driven by the agent; return the number of steps taken."""
        state, _ = self.env.reset(seed=self.seed)
        self.seed = None
        steps = 0
        while True:
            # send the state to the agent to get an action
            action = agent_rref.rpc_sync().select_action(self.id, state)
            # apply the action to the environment, and get the reward
            state, reward, terminated, truncated, _ = self.env.step(action)
            steps += 1
            # report the reward to the agent for training purpose
            agent_rref.rpc_sync().report_reward(self.id, reward)
            # CartPole-v1 truncates at 500 steps; the old gym API folded that into `done`
            if terminated or truncated:
                return steps


def discounted_returns(rewards: list[float], gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t+1}, computed backwards over one observer's rewards."""
    R, returns = 0.0, []
    for r in rewards[::-1]:
        R = r + gamma * R
        returns.insert(0, R)
    return torch.tensor(returns)


class Agent:
    """On rank 0, trainer and master: an ``RRef`` to itself (for observers to call back), one per observer."""

    observer_cls: type[Observer] = Observer  # what it creates on every observer rank

    def __init__(self, world_size: int, gamma: float = 0.99, seed: int = 1) -> None:
        self.ob_rrefs: list[RRef] = []
        self.agent_rref = RRef(self)
        self.rewards: dict[int, list[float]] = {}
        self.saved_log_probs: dict[int, list[torch.Tensor]] = {}
        self.policy = Policy()
        self.optimizer = optim.Adam(self.policy.parameters(), lr=1e-2)
        self.gamma = gamma
        self.eps = np.finfo(np.float32).eps.item()
        self.running_reward = 0.0
        self.last_loss = float("nan")
        self.reward_threshold = gym.spec(ENV_NAME).reward_threshold
        for ob_rank in range(1, world_size):
            ob_info = rpc.get_worker_info(OBSERVER_NAME.format(ob_rank))
            # each observer gets its own seed, so they do not all replay one episode
            self.ob_rrefs.append(remote(ob_info, self.observer_cls, args=(seed + ob_rank,)))
            self.rewards[ob_info.id] = []
            self.saved_log_probs[ob_info.id] = []

    def select_action(self, ob_id: int, state: np.ndarray) -> int:
        # runs on the agent, called by an observer over RPC
        state_t = torch.from_numpy(state).float().unsqueeze(0)
        probs = self.policy(state_t)
        m = Categorical(probs)
        action = m.sample()
        self.saved_log_probs[ob_id].append(m.log_prob(action))
        return action.item()

    def report_reward(self, ob_id: int, reward: float) -> None:
        self.rewards[ob_id].append(reward)

    def run_episode(self) -> dict[int, int]:
        """Start an episode on every observer at once; return {observer id: steps taken}."""
        futs = []
        for ob_rref in self.ob_rrefs:
            # make async RPC to kick off an episode on all observers (they call back into this agent)
            futs.append(ob_rref.rpc_async().run_episode(self.agent_rref))
        # wait until all observers have finished this episode
        return {ob_rref.owner().id: fut.wait() for ob_rref, fut in zip(self.ob_rrefs, futs)}

    def finish_episode(self) -> float:
        """One REINFORCE update from the episode just played; return the minimum observer reward."""
        # joins probs and returns from different observers into lists; each observer's episode is
        # discounted on its own (the tutorial's concatenation leaked rewards between observers)
        probs, returns = [], []
        for ob_id in self.rewards:
            probs.extend(self.saved_log_probs[ob_id])
            returns.append(discounted_returns(self.rewards[ob_id], self.gamma))

        # use the minimum observer reward to calculate the running reward
        min_reward = min(sum(self.rewards[ob_id]) for ob_id in self.rewards)
        self.running_reward = 0.05 * min_reward + (1 - 0.05) * self.running_reward

        # clear saved probs and rewards
        for ob_id in self.rewards:
            self.rewards[ob_id] = []
            self.saved_log_probs[ob_id] = []

        returns_t = torch.cat(returns)
        returns_t = (returns_t - returns_t.mean()) / (returns_t.std() + self.eps)
        policy_loss = torch.cat([-log_prob * R for log_prob, R in zip(probs, returns_t)]).sum()
        # before the step: a nan here would turn every weight of the policy into nan
        self.last_loss = distkit.check_finite(policy_loss.item(), "the end of an episode")
        self.optimizer.zero_grad()
        policy_loss.backward()
        self.optimizer.step()
        return float(min_reward)

