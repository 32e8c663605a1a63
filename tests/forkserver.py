"""The tests' faster start for ``distkit.launch``: each rank forked from one server process that imported
torch and the examples once, where spawn's fresh interpreter imports them again for every rank (about
3 CPU-seconds each, most of a small job's time). ``use(preload)`` starts the server and puts ``spawn``
in ``mp.spawn``'s place in ``distkit.launch``; an example run through its command line still spawns."""
from __future__ import annotations

import functools
import importlib
import multiprocessing
import os
from collections.abc import Callable
from multiprocessing import reduction
from typing import Any

import torch.multiprocessing as mp


def use(preload: list[str]) -> None:
    """Start the server now, with ``preload`` imported, after the variables every test process gets."""
    multiprocessing.set_forkserver_preload(preload)
    process = multiprocessing.get_context("forkserver").Process(target=int)
    process.start()
    process.join()
    importlib.import_module("distkit.launch").spawn = spawn  # the module (distkit.launch: the function)


def spawn(fn: Callable, args: tuple = (), nprocs: int = 1, join: bool = True) -> Any:
    """``mp.spawn``, each rank forked from the server in the launcher's surroundings of the moment."""
    return mp.start_processes(functools.partial(_run, _Surroundings(), fn), args=args, nprocs=nprocs,
                              join=join, start_method="forkserver")


class _Surroundings:
    """What a rank forked from the server takes from the launcher as it unpickles this, as a spawned
    rank does: the environment and stdout/stderr of the moment (a test's monkeypatch, capfd), not the
    server's."""

    def __reduce__(self) -> tuple:
        return _adopt, (dict(os.environ), reduction.DupFd(1), reduction.DupFd(2))


def _adopt(environ: dict[str, str], out: Any, err: Any) -> bool:
    os.environ.clear()
    os.environ.update(environ)
    os.dup2(out.detach(), 1)
    os.dup2(err.detach(), 2)
    return True


def _run(surroundings: bool, fn: Callable, index: int, *args: Any) -> None:
    # multiprocessing names the launcher as this rank's parent, and distkit's die_with_parent would take
    # the server, its parent, for a sign that the launcher is gone: the server exits with the launcher
    multiprocessing.parent_process()._pid = os.getppid()
    fn(index, *args)
