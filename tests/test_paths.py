"""Every flag that names a file or a directory is checked before any process starts.

A run must never train and then fail on a path: for each example and benchmark,
and each path flag, a file where a directory is wanted (or as its parent), a file to read that
is missing or a directory, and a place that cannot be written are each refused in one line
with exit status 2, through the same ``main()`` a user runs, before any process starts.
"""
from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, refused_before_launch, run_cli

sys.path.insert(0, str(REPO / "scripts"))


# (module whose main() a user runs, flags a valid run needs besides, flag, kind of path)
PATH_FLAGS = [
    ("rpc_rl.main", [], "--save", "out_file"),
    ("rpc_rl.main", [], "--play", "in_file"),
    ("rpc_pipeline_resnet.main", [], "--trace", "out_dir"),
    ("rpc_pipeline_resnet.pipelining", [], "--trace", "out_dir"),
    ("pipelining_transformer.train", [], "--loss_log", "out_file"),
    ("pipelining_transformer.train", [], "--trace", "out_dir"),
    ("pipelining_transformer.train", [], "--checkpoint_dir", "out_dir"),
    ("pipelining_transformer.train", ["--checkpoint_dir", "{ok_dir}"], "--resume", "in_dir"),
    ("bench_rpc_rl", [], "--plot", "out_file"),
    ("bench_ddp_rpc", [], "--plot", "out_file"),
    ("bench_rpc_rnn", [], "--plot", "out_file"),
    ("bench_rpc_pipeline_resnet", [], "--plot", "out_file"),
    ("bench_pipelining_transformer", [], "--plot", "out_file"),
    ("make_pictures", [], "--out", "out_dir"),
]


def unwritable_dir(tmp_path: Path) -> Path:
    """A directory in which no file can be made, for whoever runs the tests."""
    if os.geteuid() == 0:  # root writes through any mode bits; sysfs refuses new files
        if not os.path.isdir("/sys/kernel"):
            pytest.skip("no place root cannot write to on this machine")
        return Path("/sys/kernel")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    return locked


def bad_paths(kind: str, tmp_path: Path) -> dict[str, tuple[str, str]]:
    """Bad values for a flag of ``kind``: {case: (path, what the one line must say)}."""
    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory\n")
    locked = unwritable_dir(tmp_path)
    if kind == "out_dir":
        return {"a file": (str(a_file), "is a file, not a directory"),
                "under a file": (str(a_file / "sub"), "is a file, not a directory"),
                "unwritable": (str(locked / "new"), "cannot write in")}
    if kind == "out_file":
        return {"a directory": (str(tmp_path), "is a directory, not a file"),
                "under a file": (str(a_file / "x.out"), "is a file, not a directory"),
                "unwritable": (str(locked / "x.out"), "cannot write in")}
    if kind == "in_file":
        return {"missing": (str(tmp_path / "missing.pt"), "no such file"),
                "a directory": (str(tmp_path), "is a directory, not a file")}
    return {"missing": (str(tmp_path / "missing"), "no such directory"),
            "a file": (str(a_file), "is a file, not a directory")}


@pytest.mark.fast
@pytest.mark.parametrize("module, extra, flag, kind", PATH_FLAGS,
                         ids=[f"{m.removesuffix('.main')}{f}" for m, _, f, _ in PATH_FLAGS])
def test_bad_path_is_refused_before_launch(module, extra, flag, kind, tmp_path, capsys, monkeypatch):
    main = importlib.import_module(module).main
    ok_dir = tmp_path / "ok"
    ok_dir.mkdir()
    extra = [a.format(ok_dir=ok_dir) for a in extra]
    for case, (path, message) in bad_paths(kind, tmp_path).items():
        err = refused_before_launch(main, [*extra, flag, path], capsys, monkeypatch)
        # argparse's "argument --trace: PATH: ..." (distkit.args.path)
        assert re.search(rf"argument {flag}: {re.escape(path)}: ", err) and message in err, (case, err)


PATH_WORDS = ("path", "dir", "file", "log", "plot", "trace", "save", "play", "resume", "out", "record", "json")


@pytest.mark.fast
def test_every_path_flag_of_every_example_and_benchmark_is_in_the_list():
    """A new flag that names a file or a directory (metavar PATH or DIR) joins ``PATH_FLAGS``, so
    the test above tries it; a flag whose name sounds like a path must say which it is."""
    listed = {(m, f) for m, _, f, _ in PATH_FLAGS}
    found, unclear = set(), []
    sources = [*REPO.glob("*/*.py"), *REPO.glob("scripts/bench_*.py")]
    for path in sorted(p for p in sources if "def build_parser" in p.read_text() and p.parent.name != "tests"):
        module = path.stem if path.parent.name == "scripts" else f"{path.parent.name}.{path.stem}"
        for action in importlib.import_module(module).build_parser()._actions:
            flag = max(action.option_strings, key=len, default="")
            if action.metavar in ("PATH", "DIR"):
                found.add((module, flag))
            elif any(word in flag for word in PATH_WORDS) and not isinstance(action.metavar, str) \
                    and action.nargs != 0 and getattr(action.type, "__name__", "") not in ("int", "float"):
                unclear.append(f"{module} {flag}")
    assert found == listed, f"path flags not in PATH_FLAGS: {found - listed}; listed but gone: {listed - found}"
    assert not unclear, f"flags named like paths without metavar PATH or DIR: {unclear}"


@pytest.mark.fast
def test_good_paths_are_not_refused_and_nothing_is_made(tmp_path):
    """The check says yes to what a run can use, and leaves no trace of having looked."""
    from distkit.args import path_problem

    existing = tmp_path / "log.jsonl"
    existing.write_text("{}\n")
    assert path_problem(str(tmp_path / "new" / "deeper"), "out_dir") is None
    assert path_problem(str(tmp_path), "out_dir") is None
    assert path_problem(str(tmp_path / "new" / "plot.png"), "out_file") is None
    assert path_problem(str(existing), "out_file") is None
    assert path_problem(str(existing), "in_file") is None
    assert path_problem(str(tmp_path), "in_dir") is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.jsonl"]
    assert existing.read_text() == "{}\n"


# --- a write that fails during the run: one error naming the path and the step -------------

TINY_RUN = ("pipelining_transformer/train.py", "--world_size", "2", "--dim", "32", "--n_layers", "2",
            "--n_heads", "2", "--vocab_size", "64", "--threads", "1")


@pytest.mark.timeout(300)
def test_a_full_disk_under_the_loss_log_names_the_path_and_the_step():
    # /dev/full: every write fails with ENOSPC, as on a full disk; opening it works
    proc = run_cli(*TINY_RUN, "--steps", "3", "--loss_log", "/dev/full", timeout=240)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "--loss_log /dev/full: cannot write step 1: No space left on device" in proc.stderr, proc.stderr


@pytest.fixture
def small_disk(tmp_path):
    """A 5 MB file system: one checkpoint of the tiny model (3.7 MB) fits, two do not."""
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounting a small tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=5m", "tmpfs", str(disk)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)])


@pytest.mark.timeout(300)
def test_a_full_disk_during_a_checkpoint_leaves_the_previous_one_usable(small_disk):
    from pipelining_transformer import checkpoint

    ckpt = small_disk / "ckpt"
    proc = run_cli(*TINY_RUN, "--steps", "3", "--checkpoint_dir", str(ckpt), "--checkpoint_every", "1",
                   timeout=240)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert (f"--checkpoint_dir {ckpt}: cannot save step 2 " in proc.stderr
            and f"the newest complete checkpoint is {ckpt / 'step_1'}" in proc.stderr), proc.stderr
    assert checkpoint.latest_complete(ckpt) == ckpt / "step_1"
    assert checkpoint.problem(ckpt / "step_1") is None  # complete, and its files all there
