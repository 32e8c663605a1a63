"""A user's run prints no warnings: each example, launched as a user launches it, in its default
configuration or a shorter one, writes no 'Warning' line. (What a README's output block shows is
re-run and compared by tests/test_generated.py.)

DistributedOptimizer's DeprecationWarning for TorchScript functional optimizers, raised on
every process that owns parameters, is the one these runs used to print (see the README).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import REPO, run_cli

pytestmark = pytest.mark.fast

RUNS = {
    "rpc_rl": ("--world_size", "2", "--max_episodes", "2", "--log_interval", "1"),
    "ddp_rpc": (),  # the default runs, the READMEs' commands: a few seconds of training each
    "rpc_rnn": (),
    "rpc_pipeline_resnet": ("--splits", "1", "2", "--batch_size", "4", "--image_size", "33",
                            "--num_batches", "1"),
    "pipelining_transformer": ("--steps", "2", "--dim", "32", "--n_heads", "2", "--n_layers", "2",
                               "--vocab_size", "64"),
    # rpc_pipeline_resnet/pipelining.py: tests/test_resnet_two_pipelines.py, its README command
}
DONE = {  # what each run prints once it has done its work
    "rpc_rl": "Episode 2\t", "ddp_rpc": "fc identical on all trainers: True",
    "rpc_rnn": "in epoch 9", "rpc_pipeline_resnet": "losses with 2 split(s)", "pipelining_transformer": "step 2/2  loss ",
}


def _every_epoch_on_both_trainers(out: str) -> None:
    for rank in (0, 1):
        for epoch in range(10):
            assert f"[rank {rank}] Training done for epoch {epoch}: loss " in out, out


def _the_loss_falls(out: str) -> None:
    """rpc_rnn's default run learns its pattern: from about ln(10) to under half of it."""
    losses = [float(x) for x in re.findall(r"\[rank 1\] Training epoch \d+\tloss ([\d.]+)", out)]
    assert len(losses) == 10 and losses[0] > 1.5 and losses[-1] < 0.5 * losses[0], out
    assert f"loss {losses[0]:.4f} in epoch 0 -> {losses[-1]:.4f} in epoch 9" in out, out


def _every_split(out: str) -> None:
    for n in (1, 2):
        assert f"number of splits = {n}, execution time = " in out, out
        assert f"[rank 0] losses with {n} split(s): " in out, out


# each run's own checks: the default runs', and the lines of every --splits value
ALSO = {"ddp_rpc": _every_epoch_on_both_trainers, "rpc_rnn": _the_loss_falls,
        "rpc_pipeline_resnet": _every_split}
@pytest.mark.timeout(300)
@pytest.mark.parametrize("example", sorted(RUNS))
def test_default_run_prints_no_warning(example):
    proc = run_cli(f"{example}/main.py", *RUNS[example], timeout=240,
                   env={"PYTHONWARNINGS": ""})  # what a user's shell has, whatever CI sets
    out = proc.stdout + proc.stderr
    # rpc_rl exits 1 when two episodes do not solve CartPole, as it should, and says so
    assert proc.returncode == (1 if example == "rpc_rl" else 0), out
    assert example != "rpc_rl" or "Not solved" in proc.stderr, out
    assert DONE[example] in out, out
    warnings = [line for line in out.splitlines() if re.search("warn", line, re.IGNORECASE)]
    assert not warnings, "\n".join(warnings)
    ALSO.get(example, lambda out: None)(out)


@pytest.mark.timeout(300)
def test_the_sharded_versions_readme_commands_print_no_warning():
    """Both sharded.py files as their READMEs launch them (torchrun, 2 ranks), at once: exit 0, no
    warning, every epoch's line."""
    procs = {example: subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", f"{example}/sharded.py"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": ""}) for example in ("ddp_rpc", "rpc_rnn")}
    try:
        outs = {example: proc.communicate(timeout=240)[0] for example, proc in procs.items()}
    finally:
        for proc in procs.values():  # a run that hangs: this test fails, and leaves nothing running
            proc.kill()
    for example, out in outs.items():
        assert procs[example].returncode == 0, out
        warnings = [line for line in out.splitlines() if re.search("warn", line, re.IGNORECASE)]
        assert not warnings, "\n".join(warnings)
    _every_epoch_on_both_trainers(outs["ddp_rpc"])
    assert "fc identical on all trainers: True" in outs["ddp_rpc"], outs["ddp_rpc"]
    assert outs["rpc_rnn"].count("Training epoch 9\t") == 1, outs["rpc_rnn"]  # one line, not one a rank
