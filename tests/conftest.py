"""Shared test helpers: every test runs real processes on the CPU with gloo."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def pytest_configure(config: pytest.Config) -> None:
    # The CPU suite must behave the same on a GPU machine: it hides the GPUs (from this
    # process and every one it starts). The GPU tier, selected with `-m cuda`, sees them.
    if not re.search(r"(?<!not )\bcuda\b", config.getoption("markexpr") or ""):
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")


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
