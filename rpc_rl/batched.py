"""--batch, after PyTorch's "Batch RPC Processing Using Asynchronous Executions": one RPC per step (state
and last reward); the last observer to arrive runs one policy forward for all (``async_execution``: no RPC
thread held). Policy, sampling and ``finish_episode`` are the tutorial's, and so are one observer's actions."""
from __future__ import annotations

import threading

import numpy as np
import torch
import torch.distributed.rpc as rpc
from torch.distributed.rpc import RRef
from torch.distributions import Categorical
from torch.futures import Future

from rpc_rl.agent import Agent, Observer


class BatchObserver(Observer):
    """An observer that makes one RPC per step (plus one to report its last reward)."""

    def run_episode(self, agent_rref: RRef) -> int:
        state, _ = self.env.reset(seed=self.seed)
        self.seed = None
        reward, steps, done = None, 0, False
        while True:
            action = rpc.rpc_sync(agent_rref.owner(), BatchAgent.select_action_batch,
                                  args=(agent_rref, self.id, None if done else state, reward))
            if done:
                return steps
            state, reward, terminated, truncated, _ = self.env.step(action)
            steps += 1
            done = terminated or truncated


class BatchAgent(Agent):
    """The tutorial's agent, answering all observers of a step with one policy forward: ``pending``
    holds this step's states, ``active`` the observers still playing; ``future_actions`` answers all."""

    observer_cls = BatchObserver

    def __init__(self, world_size: int, gamma: float = 0.99, seed: int = 1) -> None:
        super().__init__(world_size, gamma, seed)
        self.lock = threading.Lock()
        self.active: set[int] = set()
        self.pending: dict[int, np.ndarray] = {}
        self.future_actions: Future = Future()

    def run_episode(self) -> dict[int, int]:
        with self.lock:
            self.active = set(self.rewards)
        return super().run_episode()

    @staticmethod
    @rpc.functions.async_execution
    def select_action_batch(agent_rref: RRef, ob_id: int, state: np.ndarray | None,
                            reward: float | None) -> Future:
        """Record ``reward`` for the previous action; answer ``state`` with an action later. ``state`` None:
        the observer's episode is over, it leaves the batch so that the others do not wait for it."""
        self: BatchAgent = agent_rref.local_value()
        with self.lock:
            if reward is not None:
                self.rewards[ob_id].append(reward)
            if state is None:
                self.active.discard(ob_id)
                answer: Future = Future()
                answer.set_result(-1)
            else:
                self.pending[ob_id] = state
                answer = self.future_actions.then(lambda fut: fut.value()[ob_id])
            full = bool(self.pending) and len(self.pending) == len(self.active)
            if full:  # one policy forward for every pending observer
                ob_ids = sorted(self.pending)
                states = torch.from_numpy(np.stack([self.pending[i] for i in ob_ids])).float()
                m = Categorical(self.policy(states))
                actions = m.sample()
                log_probs = m.log_prob(actions)
                for row, i in enumerate(ob_ids):  # not ob_id: the lambda above reads it
                    self.saved_log_probs[i].append(log_probs[row:row + 1])
                future, self.future_actions, self.pending = self.future_actions, Future(), {}
        if full:  # answers every observer waiting on this step
            future.set_result({i: int(a) for i, a in zip(ob_ids, actions.tolist())})
        return answer
