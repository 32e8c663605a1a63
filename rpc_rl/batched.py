"""Going past the tutorial: one RPC per step and one batched policy forward per step.

The tutorial names its own inefficiency: every environment step costs two RPCs, and the
agent runs the policy once per observer. PyTorch's "Batch RPC Processing Using
Asynchronous Executions" shows the cure used here:

- a ``BatchObserver`` sends its state *and the reward of its previous action* in one RPC;
- ``BatchAgent.select_action_batch`` is an ``@rpc.functions.async_execution`` function: it
  returns a future at once instead of holding an RPC thread, and the last observer to
  arrive runs one policy forward for everyone and completes all their futures.

The policy, the sampling and ``finish_episode`` are the tutorial's, unchanged: with one
observer and the same seed this mode takes exactly the same actions as the faithful one.
"""
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
    """The tutorial's agent, answering all observers of a step with one policy forward.

    ``pending`` holds the states that arrived for the current step; ``active`` the observers
    still playing this episode. When every active observer has sent its state, the batch
    runs and ``future_actions`` is completed, which answers all of them at once.
    """

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
        """Record ``reward`` for the previous action; answer ``state`` with an action later.

        Runs on the agent. ``state is None`` means the observer's episode is over: it only
        reports its final reward and leaves the batch, so the others do not wait for it.
        """
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
            batch = self._take_batch() if self.pending and len(self.pending) == len(self.active) else None
        if batch is not None:
            future, actions = batch
            future.set_result(actions)  # answers every observer waiting on this step
        return answer

    def _take_batch(self) -> tuple[Future, dict[int, int]]:
        """One policy forward for every pending observer (called with the lock held)."""
        ob_ids = sorted(self.pending)
        states = torch.from_numpy(np.stack([self.pending[i] for i in ob_ids])).float()
        probs = self.policy(states)
        m = Categorical(probs)
        actions = m.sample()
        log_probs = m.log_prob(actions)
        for row, ob_id in enumerate(ob_ids):
            self.saved_log_probs[ob_id].append(log_probs[row:row + 1])
        future, self.future_actions, self.pending = self.future_actions, Future(), {}
        return future, {ob_id: int(a) for ob_id, a in zip(ob_ids, actions.tolist())}
