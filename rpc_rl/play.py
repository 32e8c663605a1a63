"""Save a trained policy, and play CartPole with it in this process (no RPC)."""
from __future__ import annotations

import os
from pathlib import Path

import gymnasium as gym
import torch

from rpc_rl.agent import ENV_NAME, Policy


def save_policy(policy: Policy, path: str, **info: object) -> None:
    """Write atomically: a run killed mid-save leaves the previous file, never half of one."""
    tmp = Path(f"{path}.tmp")
    tmp.parent.mkdir(parents=True, exist_ok=True)  # as --save's check before launch allows
    torch.save({"policy": policy.state_dict(), **info}, tmp)
    os.replace(tmp, path)


def load_policy(path: str) -> Policy:
    """Raises ValueError, one line, when ``path`` holds no policy. Not torch.load's reason: it spans
    lines and advises ``weights_only=False``, which would run whatever code the file holds."""
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
        policy = Policy()
        policy.load_state_dict(saved["policy"])
    except Exception:  # unpickling errors, missing keys, wrong shapes all mean the same
        raise ValueError(f"{path} is not a saved rpc_rl policy") from None
    return policy.eval()


def play(policy: Policy, episodes: int, seed: int) -> list[float]:
    """Run ``episodes`` episodes choosing the most likely action (no dropout, no sampling)."""
    env = gym.make(ENV_NAME)
    rewards = []
    for i in range(episodes):
        state, _ = env.reset(seed=seed + i)
        total, done = 0.0, False
        while not done:
            with torch.no_grad():
                probs = policy(torch.from_numpy(state).float().unsqueeze(0))
            state, reward, terminated, truncated, _ = env.step(int(probs.argmax()))
            total += reward
            done = terminated or truncated
        rewards.append(total)
    return rewards
