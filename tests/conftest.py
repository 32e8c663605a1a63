"""Shared test helpers: every test runs real processes on the CPU with gloo."""
from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# the sections of every example README that tests/test_tutorial_maps.py reads
HEADING = "## Where each tutorial step is"
DIFFERS = "## What differs from the tutorial, and why"


def pytest_configure(config: pytest.Config) -> None:
    # The CPU suite must behave the same on a GPU machine: it hides the GPUs (from this
    # process and every one it starts). The GPU tier, selected with `-m cuda`, sees them.
    if not re.search(r"(?<!not )\bcuda\b", config.getoption("markexpr") or ""):
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")


def checked_args(example: str, *argv: str) -> argparse.Namespace:
    """``argv`` as ``example``'s own ``build_parser`` and ``check_args`` leave it (``example``:
    a module, "rpc_rl.main"), the namespace a run gets. Each test file's ``make_args``."""
    module = importlib.import_module(example)  # here, not above: no torch before pytest_configure
    parser = module.build_parser()
    args = parser.parse_args(list(argv))
    module.check_args(parser, args)
    return args


def run_cli(*argv: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``python <argv>`` from the repository root, as a user would; capture its output."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=full_env)


def run_torchrun(nproc: int, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Launch ``argv`` with ``torchrun --standalone``, one rank per process."""
    return run_cli("-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                   *argv, timeout=timeout)


@pytest.fixture
def cli():
    return run_cli


def refused_before_launch(main, argv: list[str], capsys, monkeypatch) -> str:
    """``main(argv)`` exits with status 2 and one line on stderr before it launches anything
    (in this process: a process per case would cost seconds each); returns that line."""
    # imported here: conftest must not import torch before pytest_configure hides the GPUs
    import distkit

    # were a check to let bad input through, the test fails here instead of training
    monkeypatch.setattr(distkit, "launch", lambda *a: pytest.fail("launched despite bad input"))
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert err.count("\n") == 1, err
    return err


# assert_close's own tolerances for float32, for Python floats that hold float32 results (a
# loss's .item()): given two floats, it would compare them as float64, to 1e-7.
FLOAT32 = {"rtol": 1.3e-6, "atol": 1e-5}
# A float32 loss below 10 printed to 4 decimals: half its last digit, plus float32's rounding.
PRINTED_4 = 5e-5 + 2e-5


# For a CPU capability torch reports, another that real machines run the same code with:
# AVX-512 machines also run AVX2's kernels, and many machines have only AVX2. Not "default"
# (ATen's scalar kernels) below AVX2: with them in the workers, BatchNorm over micro-batches of
# 2 images moved a ResNet's second loss by 6 % (measured), a mismatch between kernels that no
# run on one machine has.
NARROWER_CAPABILITY = {"AVX512": "avx2"}


@pytest.fixture(autouse=True, scope="session")
def workers_round_differently():
    """Every process a test starts computes with other float rounding than the test's own
    reference, where this CPU allows it: ATen's AVX2 kernels on an AVX-512 machine
    (``ATEN_CPU_CAPABILITY``), so a float32 sum adds in another order, as on a user's
    machine; ranks that share the cores also have fewer intra-op threads than this process.
    A parity test whose tolerance is tuned to this machine's last bits then fails here, not
    there (issue 32: AVX2 against AVX-512 turned a loss of 0.06872105 into 0.06872070).
    ``test_workers_round_differently`` checks that it holds; yields the value set, or None."""
    import torch

    # read now, so that this process's own kernels are fixed before the variable is set
    native = torch.backends.cpu.get_cpu_capability()
    narrower = NARROWER_CAPABILITY.get(native)
    with pytest.MonkeyPatch.context() as mp:
        if narrower is not None:
            mp.setenv("ATEN_CPU_CAPABILITY", narrower)
        yield narrower
