"""A user's run prints no warnings: each example, launched as a user launches it, in a tiny
configuration (the default one, made shorter), writes no 'Warning' line.

DistributedOptimizer's DeprecationWarning for TorchScript functional optimizers, raised on
every process that owns parameters, is the one these runs used to print (see the README).
"""
from __future__ import annotations

import re

import pytest

from conftest import run_cli

pytestmark = pytest.mark.fast

RUNS = {
    "rpc_rl": ("--world_size", "2", "--max_episodes", "2", "--log_interval", "1"),
    "ddp_rpc": ("--epochs", "1", "--batches_per_epoch", "2"),
    "rpc_rnn": ("--epochs", "1", "--batches", "3"),
    "rpc_pipeline_resnet": ("--splits", "1", "2", "--batch_size", "4", "--image_size", "33",
                            "--num_batches", "1", "--warmup", "0"),
    "pipelining_transformer": ("--steps", "2", "--dim", "32", "--n_heads", "2", "--n_layers", "2",
                               "--vocab_size", "64"),
}
DONE = {  # what each run prints once it has done its work
    "rpc_rl": "Episode 2\t", "ddp_rpc": "fc identical on all trainers: True",
    "rpc_rnn": "in epoch 0", "rpc_pipeline_resnet": "speed-up", "pipelining_transformer": "2 steps in",
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("example", sorted(RUNS))
def test_default_run_prints_no_warning(example):
    proc = run_cli(f"{example}/main.py", *RUNS[example], timeout=240,
                   env={"PYTHONWARNINGS": ""})  # what a user's shell has, whatever CI sets
    out = proc.stdout + proc.stderr
    # rpc_rl exits 1 when two episodes do not solve CartPole, as it should
    assert proc.returncode in ((0, 1) if example == "rpc_rl" else (0,)), out
    assert DONE[example] in out, out
    warnings = [line for line in out.splitlines() if re.search("warn", line, re.IGNORECASE)]
    assert not warnings, "\n".join(warnings)
