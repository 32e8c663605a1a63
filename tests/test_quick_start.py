"""The README's first command, ``bash scripts/run_examples.sh``, with a stand-in interpreter.

Each example's own run is tested beside its README (test_quiet_output.py and the examples'
tests); here, the script around them: every command it runs is one its example accepts, it
says how long the run has taken at each example, and a run stopped from outside says where it
was. A "stall" of the quick start once reported was a 150 s limit around the whole script, which
takes about 2 1/4 minutes on 2 idle cores: the examples were still computing when it was cut
(docs/failures.md).
"""
from __future__ import annotations

import importlib
import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = pytest.mark.fast

SCRIPT = REPO / "scripts" / "run_examples.sh"


def stand_in(tmp_path: Path, sleep: float = 0) -> tuple[Path, Path]:
    """An interpreter that records its arguments, one line per call, and sleeps ``sleep`` s."""
    calls = tmp_path / "calls"
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/bash\necho "$*" >> {shlex.quote(str(calls))}\nsleep {sleep}\n')
    fake.chmod(0o755)
    return fake, calls


def test_every_command_of_the_quick_start_runs_and_is_timed(tmp_path):
    fake, calls = stand_in(tmp_path)
    proc = subprocess.run(["bash", str(SCRIPT)], env={**os.environ, "PYTHON": str(fake)},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    commands = [line.split() for line in calls.read_text().splitlines()]
    examples = [argv[0] for argv in commands]
    assert {"rpc_rl/main.py", "ddp_rpc/main.py", "rpc_rnn/main.py", "rpc_pipeline_resnet/main.py",
            "rpc_pipeline_resnet/pipelining.py", "pipelining_transformer/main.py"} <= set(examples)
    for k, argv in enumerate(commands, start=1):
        # the line a reader sees when an example starts: which, and the time so far
        assert re.search(rf"^=== \[{k}/{len(commands)}, \d+ s so far\] {re.escape(str(fake))} "
                         rf"{re.escape(' '.join(argv))}$", proc.stdout, re.M), proc.stdout
        # each command's flags are its example's: a renamed flag fails here, not on a user's machine
        module = importlib.import_module(argv[0].removesuffix(".py").replace("/", "."))
        module.build_parser().parse_args(argv[1:])
    assert re.search(rf"^=== all {len(commands)} runs finished in \d+ s$", proc.stdout, re.M), proc.stdout


def test_a_quick_start_stopped_from_outside_says_where_it_was(tmp_path):
    fake, _ = stand_in(tmp_path, sleep=60)
    proc = subprocess.Popen(["bash", str(SCRIPT)], env={**os.environ, "PYTHON": str(fake)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    time.sleep(2)
    os.killpg(proc.pid, signal.SIGTERM)  # as `timeout` does: the script and the example it runs
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 143, (out, err)
    assert re.search(rf"run_examples.sh: stopped from outside \(SIGTERM\) after \d+ s, in run 1 of \d+: "
                     rf"{re.escape(str(fake))} rpc_rl/main.py", err), err


def test_python_may_name_a_command_on_the_path(tmp_path):
    """PYTHON=python3, as a user writes it: a command found on the PATH runs the examples."""
    fake, calls = stand_in(tmp_path)
    env = {**os.environ, "PYTHON": "python", "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    proc = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert calls.read_text().splitlines()[0].startswith("rpc_rl/main.py ")


@pytest.mark.parametrize("python", [None, "no/such/python", "no-such-command"])
def test_without_the_venv_the_quick_start_says_what_to_run_first(tmp_path, python):
    """In a copy of the script with no ``.venv`` beside it (a fresh clone before the set-up),
    or with PYTHON naming no interpreter: one line naming the set-up command, exit 2."""
    (tmp_path / "scripts").mkdir()
    copy = tmp_path / "scripts" / "run_examples.sh"
    copy.write_text(SCRIPT.read_text())
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"} | ({"PYTHON": python} if python else {})
    proc = subprocess.run(["bash", str(copy)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("run_examples.sh: "), proc.stderr
    assert "python3 -m venv .venv && .venv/bin/pip install -c constraints.txt -e ." in proc.stderr, proc.stderr
    assert "===" not in proc.stdout, proc.stdout  # no example started
