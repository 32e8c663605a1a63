"""rpc_rl: the REINFORCE update, the agent/observer bookkeeping, determinism, launchers."""
from __future__ import annotations

import argparse
import copy

import gymnasium as gym
import numpy as np
import pytest
import torch
import torch.distributed.rpc as rpc
import torch.nn.functional as F
from torch.distributions import Categorical
from torch.multiprocessing.spawn import ProcessRaisedException

import distkit
from conftest import FLOAT32, checked_args, refused_before_launch, run_cli, run_torchrun
from rpc_rl.agent import AGENT_NAME, Agent, Policy, discounted_returns
from rpc_rl.batched import BatchAgent, BatchObserver
from rpc_rl.main import build_parser, run_worker
from rpc_rl.play import load_policy, play, save_policy


def make_args(*argv: str) -> argparse.Namespace:
    return checked_args("rpc_rl.main", *argv)


def test_discounted_returns_by_hand():
    torch.testing.assert_close(discounted_returns([1.0, 1.0, 1.0], 0.9),
                               torch.tensor([2.71, 1.9, 1.0]))


def _finish_episode_worker(rank: int, args: argparse.Namespace) -> dict:
    """An agent with no observers; feed it two observers' episodes by hand."""
    rpc.init_rpc(AGENT_NAME, rank=0, world_size=1)
    torch.manual_seed(0)
    agent = Agent(world_size=1, gamma=0.9)
    agent.policy.eval()  # no dropout: the reference can recompute the same probabilities
    before = copy.deepcopy(agent.policy)
    gen = torch.Generator().manual_seed(1)
    episodes = {7: [1.0, 1.0, 1.0], 8: [1.0, 0.5]}
    states, actions = [], []
    for ob_id, rewards in episodes.items():
        agent.rewards[ob_id], agent.saved_log_probs[ob_id] = [], []
        for r in rewards:
            state = torch.randn(4, generator=gen).numpy()
            actions.append(agent.select_action(ob_id, state))
            states.append(state)
            agent.report_reward(ob_id, r)
    min_reward = agent.finish_episode()
    rpc.shutdown()
    return {"loss": agent.last_loss, "min_reward": min_reward, "before": before,
            "after": agent.policy, "states": np.stack(states), "actions": actions,
            "running_reward": agent.running_reward, "left": sum(map(len, agent.rewards.values()))}


def _assert_agent_took_this_step(out: dict, ref: Policy, loss: torch.Tensor) -> None:
    """The agent's loss is ``loss`` (computed here on ``ref``, the policy before the
    update), and its policy after the update is ``ref`` after one Adam step on it."""
    # float32 sums, added in another order in the agent's process
    torch.testing.assert_close(out["loss"], loss.item(), **FLOAT32)
    opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    loss.backward()
    opt.step()
    for (name, p_ref), p in zip(ref.named_parameters(), out["after"].parameters()):
        torch.testing.assert_close(p, p_ref, msg=lambda m: f"{name}: {m}")


def test_finish_episode_matches_hand_computation():
    args = make_args()
    args.world_size = 1  # the agent alone
    out = distkit.launch(_finish_episode_worker, args)[0]
    # returns per observer, by hand: [1 + .9 + .81, 1 + .9, 1] and [1 + .9 * .5, .5]
    returns = torch.tensor([2.71, 1.9, 1.0, 1.45, 0.5])
    returns = (returns - returns.mean()) / (returns.std() + np.finfo(np.float32).eps)
    ref = out["before"]
    probs = ref(torch.from_numpy(out["states"]).float())
    log_probs = Categorical(probs).log_prob(torch.tensor(out["actions"]))
    loss = -(log_probs * returns).sum()
    _assert_agent_took_this_step(out, ref, loss)
    assert out["min_reward"] == 1.5  # observer 8 earned 1.5, observer 7 earned 3
    assert out["running_reward"] == pytest.approx(0.05 * 1.5)
    assert out["left"] == 0  # the episode's rewards were cleared


def _bookkeeping_worker(rank: int, args: argparse.Namespace) -> dict | None:
    if rank != 0:
        return run_worker(rank, args)  # an observer, exactly as in the example
    rpc.init_rpc(AGENT_NAME, rank=0, world_size=args.world_size)
    torch.manual_seed(args.seed)
    agent = (BatchAgent if args.batch else Agent)(args.world_size, args.gamma, args.seed)
    before = [p.detach().clone() for p in agent.policy.parameters()]
    episodes = []
    for _ in range(3):
        steps = agent.run_episode()
        episodes.append({ob: (steps[ob], len(agent.rewards[ob]), len(agent.saved_log_probs[ob]))
                         for ob in agent.rewards})
        agent.finish_episode()
    after = [p.detach().clone() for p in agent.policy.parameters()]
    rpc.shutdown()
    return {"episodes": episodes, "before": before, "after": after}


@pytest.mark.parametrize("argv", [("--world_size", "3"), ("--world_size", "5", "--batch")])
def test_observers_report_every_step_and_every_parameter_moves(argv):
    out = distkit.launch(_bookkeeping_worker, make_args(*argv))[0]
    n_obs = int(argv[1]) - 1
    for episode in out["episodes"]:
        assert sorted(episode) == list(range(1, n_obs + 1))  # every observer played
        for steps, n_rewards, n_log_probs in episode.values():
            assert steps >= 1
            assert n_rewards == n_log_probs == steps
    changed = [not torch.equal(b, a) for b, a in zip(out["before"], out["after"])]
    assert all(changed), "every policy parameter should move after three updates"


# ---- --batch with several observers: the right action to the right observer ----

class Recorder(gym.Wrapper):
    """Remembers every (state, action, reward) of its environment, on the observer's side."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        self.log: list[tuple[np.ndarray, int, float]] = []

    def reset(self, **kwargs):
        self.state, info = self.env.reset(**kwargs)
        return self.state, info

    def step(self, action):
        state, reward, terminated, truncated, info = self.env.step(action)
        self.log.append((self.state, int(action), float(reward)))
        self.state = state
        return state, reward, terminated, truncated, info


class RecordingObserver(BatchObserver):
    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.env = Recorder(self.env)

    def take_log(self) -> list[tuple[np.ndarray, int, float]]:
        log, self.env.log = self.env.log, []
        return log


class RecordingBatchAgent(BatchAgent):
    observer_cls = RecordingObserver


class ParityPolicy(torch.nn.Module):
    """Probability 1 for an action that is a fixed function of the state: one that differs
    between two observers' states about half of the time, so a swapped action shows."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # summed in float64: a float32 sum, added in another order in the agent's batch, could
        # land on the other side of a k/1000 step than this process's sum of one state
        return F.one_hot((x.double().sum(dim=1) * 1000).floor().long() % 2, 2).float()


def _batched_observers_worker(rank: int, args: argparse.Namespace) -> dict | None:
    if rank != 0:
        return run_worker(rank, args)  # observers, exactly as in the example
    rpc.init_rpc(AGENT_NAME, rank=0, world_size=args.world_size)
    torch.manual_seed(args.seed)
    agent = RecordingBatchAgent(args.world_size, args.gamma, args.seed)
    take_logs = lambda: {r.owner().id: r.rpc_sync().take_log() for r in agent.ob_rrefs}  # noqa: E731
    # 1. one REINFORCE update from one batched episode of every observer; no dropout, so
    # that one process can recompute the policy's probabilities
    agent.policy.eval()
    before = copy.deepcopy(agent.policy)
    agent.run_episode()
    episode = take_logs()
    agent.finish_episode()
    out = {"before": before, "after": agent.policy, "loss": agent.last_loss, "episode": episode}
    # 2. a policy whose action is a function of the state: every observer must get its own
    agent.policy = ParityPolicy()
    agent.run_episode()
    out["routed"] = take_logs()
    rpc.shutdown()
    return out


def test_batched_agent_answers_each_observer_and_updates_like_one_process():
    args = make_args("--world_size", "4", "--batch", "--seed", "5", "--gamma", "0.9")
    out = distkit.launch(_batched_observers_worker, args)[0]
    assert sorted(out["routed"]) == sorted(out["episode"]) == [1, 2, 3]
    parity = ParityPolicy()
    for ob_id, log in out["routed"].items():
        assert len(log) >= 8  # a CartPole episode lasts at least 8 steps
        for step, (state, action, _) in enumerate(log):
            expected = int(parity(torch.from_numpy(state).float().unsqueeze(0)).argmax())
            assert action == expected, f"observer {ob_id}, step {step}: got another observer's action"

    # the REINFORCE update, in one process, from the states, actions and rewards the
    # observers themselves recorded (in the agent's order of observers)
    ref, initial = out["before"], dict(copy.deepcopy(out["before"]).named_parameters())
    log_probs, returns = [], []
    for ob_id in sorted(out["episode"]):
        states, actions, rewards = zip(*out["episode"][ob_id])
        probs = ref(torch.from_numpy(np.stack(states)).float())
        log_probs.append(Categorical(probs).log_prob(torch.tensor(actions)))
        returns.append(discounted_returns(list(rewards), 0.9))
    returns_t = torch.cat(returns)
    returns_t = (returns_t - returns_t.mean()) / (returns_t.std() + np.finfo(np.float32).eps)
    loss = -(torch.cat(log_probs) * returns_t).sum()
    _assert_agent_took_this_step(out, ref, loss)
    for name, p in out["after"].named_parameters():
        assert not torch.equal(p, initial[name]), f"{name} did not move"


def _nan_episode_worker(rank: int, args: argparse.Namespace) -> None:
    """One observer's one-step episode: the normalised return is 0 / 0."""
    rpc.init_rpc(AGENT_NAME, rank=0, world_size=1)
    agent = Agent(world_size=1)
    agent.rewards[7], agent.saved_log_probs[7] = [], []
    agent.select_action(7, np.zeros(4, dtype=np.float32))
    agent.report_reward(7, 1.0)
    agent.finish_episode()


def test_a_non_finite_loss_stops_before_the_update():
    args = make_args()
    args.world_size = 1  # the agent alone
    with pytest.raises(ProcessRaisedException) as failure:  # mp.spawn's report: the rank's traceback
        distkit.launch(_nan_episode_worker, args)
    assert "FloatingPointError: the loss is nan at the end of an episode" in str(failure.value)


def _reinforce_in_one_process(seed: int, gamma: float, episodes: int) -> tuple[list[float], dict]:
    """The tutorial's algorithm with one observer, written out in one process with no RPC.

    The same random streams as the distributed run: the agent's torch seed draws the policy's
    weights, dropout masks and actions in the same order, and the observer's environment is
    seeded with seed + its rank (1).
    """
    torch.manual_seed(seed)
    policy = Policy()
    opt = torch.optim.Adam(policy.parameters(), lr=1e-2)
    env = gym.make("CartPole-v1")
    eps = np.finfo(np.float32).eps.item()
    totals, env_seed = [], seed + 1
    for _ in range(episodes):
        state, _ = env.reset(seed=env_seed)
        env_seed = None  # later episodes continue the environment's own stream
        log_probs, rewards, done = [], [], False
        while not done:
            m = Categorical(policy(torch.from_numpy(state).float().unsqueeze(0)))
            action = m.sample()
            log_probs.append(m.log_prob(action))
            state, reward, terminated, truncated, _ = env.step(action.item())
            rewards.append(reward)
            done = terminated or truncated
        G, returns = 0.0, []
        for r in reversed(rewards):
            G = r + gamma * G
            returns.insert(0, G)
        returns_t = torch.tensor(returns)
        returns_t = (returns_t - returns_t.mean()) / (returns_t.std() + eps)
        loss = torch.cat([-lp * R for lp, R in zip(log_probs, returns_t)]).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        totals.append(sum(rewards))
    return totals, policy.state_dict()


@pytest.mark.fast  # also on Python 3.10 and 3.13 (.ci/run)
@pytest.mark.parametrize("batch", [False, True])
def test_one_observer_run_equals_single_process_reinforce(batch):
    argv = ["--world_size", "2", "--max_episodes", "4", "--log_interval", "100", "--seed", "2",
            "--gamma", "0.95"]
    out = distkit.launch(run_worker, make_args(*argv, *(["--batch"] if batch else [])))[0]
    rewards, policy = _reinforce_in_one_process(seed=2, gamma=0.95, episodes=4)
    assert out["rewards"] == rewards  # the same actions, so the same episodes
    for name, p in policy.items():
        torch.testing.assert_close(out["policy"][name], p, msg=lambda m: f"{name}: {m}")


def test_another_seed_gives_another_run():
    """--seed reaches the run: seed 3 plays seed 3's one-process replay, not seed 2's (which seed 2's run
    plays: test_one_observer_run_equals_single_process_reinforce)."""
    argv = ("--world_size", "2", "--max_episodes", "4", "--log_interval", "100", "--gamma", "0.95")
    rewards = distkit.launch(run_worker, make_args(*argv, "--seed", "3"))[0]["rewards"]
    assert rewards == _reinforce_in_one_process(seed=3, gamma=0.95, episodes=4)[0]
    assert rewards != _reinforce_in_one_process(seed=2, gamma=0.95, episodes=4)[0]


# the CLI stopping at --max_episodes, exit 1 and "Not solved": test_quiet_output.py's rpc_rl run


def test_torchrun_launch_solves_easy_threshold():
    # 3 processes, not the default --world_size 2: torchrun's WORLD_SIZE decides
    proc = run_torchrun(3, "rpc_rl/main.py", "--reward_threshold", "0.5", "--max_episodes", "5")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Solved! Running reward is now" in proc.stdout


@pytest.mark.parametrize("argv, message", [
    (["--world_size", "1"], "--world_size must be at least 2"),
    (["--max_episodes", "-3"], "argument --max_episodes: must be at least 1, got -3"),
    (["--gamma", "0"], "argument --gamma: must be in (0, 1], got 0.0"),
    (["--gamma", "1.5"], "argument --gamma: must be in (0, 1], got 1.5"),
    (["--world_size", "three"], "invalid int value"),
    # the launch flags every example shares
    (["--hang_timeout", "nan"], "argument --hang_timeout: must be 0 (never) or a positive number, got nan"),
    (["--threads", "0"], "argument --threads: must be at least 1, got 0"),
])
def test_bad_input_is_one_line_exit_2(argv, message, capsys, monkeypatch):
    from rpc_rl.main import main

    assert message in refused_before_launch(main, argv, capsys, monkeypatch)


def test_bad_input_from_the_command_line_is_one_line_exit_2():
    """As a shell sees it (the other cases in-process: a Python start-up each)."""
    proc = run_cli("rpc_rl/main.py", "--world_size", "1", timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "--world_size must be at least 2" in proc.stderr, proc.stderr
    assert "[rank" not in proc.stdout  # nothing was spawned


def test_a_negative_seed_is_refused(capsys, monkeypatch):
    """An observer's environment is reset with seed + rank, which gymnasium refuses below 0:
    --seed -2 failed on rank 1 after the launch (found by tests/test_bench_flags.py)."""
    from rpc_rl.main import main

    err = refused_before_launch(main, ["--seed", "-2"], capsys, monkeypatch)
    assert "argument --seed: must be at least 0, got -2" in err, err


def test_save_then_play(tmp_path):
    path = tmp_path / "policy.pt"
    out = distkit.launch(run_worker, make_args("--world_size", "2", "--max_episodes", "3",
                                               "--log_interval", "100", "--save", str(path)))[0]
    saved = load_policy(str(path))
    for name, p in out["policy"].items():
        torch.testing.assert_close(saved.state_dict()[name], p)  # what the agent trained
    proc = run_cli("rpc_rl/main.py", "--play", str(path), "--play_episodes", "3", "--seed", "7")
    assert proc.returncode == 0, proc.stderr
    printed = [float(line.split("Reward: ")[1]) for line in proc.stdout.splitlines()]
    assert printed == play(saved, 3, seed=7)  # greedy play is deterministic
    assert all(r >= 1 for r in printed)


def test_play_refuses_a_truncated_file(tmp_path):
    good = tmp_path / "good.pt"
    save_policy(Policy(), str(good))
    bad = tmp_path / "bad.pt"
    bad.write_bytes(good.read_bytes()[:100])
    proc = run_cli("rpc_rl/main.py", "--play", str(bad), timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "is not a saved rpc_rl policy" in proc.stderr


def test_play_refuses_a_file_that_is_no_tensor_file_in_one_line():
    proc = run_cli("rpc_rl/main.py", "--play", "/etc/hostname", timeout=60)
    assert proc.returncode == 2
    # torch.load's own message spans lines and suggests weights_only=False (unsafe): not shown
    assert proc.stderr == "main.py: error: /etc/hostname is not a saved rpc_rl policy\n", proc.stderr


def test_there_is_no_device_flag_to_ignore(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["--device", "cpu"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --device" in capsys.readouterr().err
