"""``--hang_timeout``: a job that stops making progress ends, with every rank's Python stack.

Progress is what the tutorial's code does, seen through PyTorch's global hooks, so no example
carries a line for it: a module's forward (an episode's policy, a batch through the embedding,
a micro-batch through a shard or a stage) or an optimizer step, on any rank of the job. A
rank's watchdog thread adds its rank's progress to one counter in the job's rendezvous store
and watches that counter: when the whole job has made none for ``hang_timeout`` seconds, the
first rank to notice claims the hang and asks every rank, through the store, for its stack.

Why our own: PyTorch bounds one call at a time (the process group's ``timeout=``, the RPC's
``rpc_timeout``, ``monitored_barrier``), not a rank that stops between calls, and an idle RPC
server waits forever by design; torchrun's file timer (``TORCHELASTIC_ENABLE_FILE_TIMER``)
bounds regions a rank opens itself, with one machine's agent, and prints no stack; a
SIGSTOPped rank cannot report anything. The stacks are ``faulthandler``'s (every thread, no
GIL needed); the stopped rank cannot give one, and the report says so.
"""
from __future__ import annotations

import faulthandler
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_hook
from torch.optim.optimizer import register_optimizer_step_post_hook

from .rendezvous import STORE_TIMEOUT, connect, restart_key

ANSWER_WAIT = 5.0  # seconds the claiming rank waits for the others' stacks


class Watchdog:
    """Lives in every rank: counts this rank's progress, publishes it, watches the job's."""

    def __init__(self, rank: int, world_size: int, timeout: float,
                 on_hang: Callable[[str], None], end_silent: bool = False) -> None:
        self.rank, self.world_size, self.timeout, self.on_hang = rank, world_size, timeout, on_hang
        self.end_silent = end_silent  # SIGKILL a rank on this machine that does not answer
        self.interval = min(1.0, max(0.05, timeout / 10))
        self.ticks = 0  # bumped by the hooks, read by the thread: any change is progress
        self._stop = threading.Event()
        self._hooks: list[Any] = []
        # its own client, bounded like every wait on the store (rank 0 may still be starting it)
        self.store = connect(max(STORE_TIMEOUT, timedelta(seconds=timeout)))
        self.prefix = f"distkit/watchdog/{restart_key()}"

    def _key(self, name: str) -> str:
        return self.prefix + name

    def tick(self, *_: Any) -> None:
        if not torch.compiler.is_compiling():  # the tracer split exports the model
            self.ticks += 1

    def start(self) -> Watchdog:
        self._hooks = [register_module_forward_hook(self.tick),
                       register_optimizer_step_post_hook(self.tick)]
        self.store.set(self._key(f"pid/{self.rank}"), f"{socket.gethostname()} {os.getpid()}")
        # the first heartbeat now, not an interval later: a rank frozen within its first
        # interval would otherwise read as "not started yet" and get start-up's long bound
        self.store.add(self._key(f"alive/{self.rank}"), 1)
        threading.Thread(target=self._run, name="distkit-watchdog", daemon=True).start()
        return self

    def stop(self) -> None:
        """This rank is done: the others stop expecting its heartbeat."""
        self._stop.set()
        try:
            self.store.set(self._key(f"finished/{self.rank}"), "1")
        except Exception:
            pass
        for hook in self._hooks:
            hook.remove()

    def _run(self) -> None:
        published, last_total, last_change = 0, -1, time.monotonic()
        armed = False  # until the job's first progress, start-up gets the store's bound
        beats: dict[int, tuple[int, float]] = {}  # rank -> (heartbeat count, when it last moved)
        try:
            while not self._stop.wait(self.interval):
                if self.ticks != published:
                    published = self.ticks
                    self.store.add(self._key("progress"), 1)
                self.store.add(self._key(f"alive/{self.rank}"), 1)
                if self.store.check([self._key("hang")]):
                    return self._answer()
                now = time.monotonic()
                total = self.store.add(self._key("progress"), 0)
                if total != last_total:
                    armed, last_total, last_change = armed or total > 0, total, now
                bound = self.timeout if armed else max(self.timeout, STORE_TIMEOUT.total_seconds())
                if now - last_change > bound:
                    return self._claim(f"no progress in {now - last_change:.0f} s "
                                       f"(--hang_timeout {self.timeout:g}) on any of the "
                                       f"{self.world_size} ranks")
                # a rank whose watchdog stopped beating is stopped or frozen, even while the
                # others still make progress (ddp_rpc's trainers go on without their master)
                for rank in range(self.world_size):
                    beat = self.store.add(self._key(f"alive/{rank}"), 0)
                    if beat == 0 or self.store.check([self._key(f"finished/{rank}")]):
                        continue  # not started yet (start-up is the rendezvous' business), or done
                    if beats.get(rank, (None,))[0] != beat:
                        beats[rank] = (beat, now)
                    elif now - beats[rank][1] > self.timeout:
                        return self._claim(f"rank {rank} stopped answering for "
                                           f"{now - beats[rank][1]:.0f} s (--hang_timeout "
                                           f"{self.timeout:g})")
        except Exception as e:  # the store is gone: a rank of its own cannot ask the others
            if not self._stop.is_set():
                self._report_and_exit(f"rank {self.rank}: the job's rendezvous store stopped "
                                      f"answering ({e}); this rank's stack follows")

    def _claim(self, why: str) -> None:
        """The first rank here reports the hang and collects everyone's stacks."""
        claimed = self.store.compare_set(self._key("hang"), "", str(self.rank)).decode()
        if claimed != str(self.rank):
            return self._answer()
        deadline = time.monotonic() + ANSWER_WAIT
        others = [r for r in range(self.world_size) if r != self.rank
                  and not self.store.check([self._key(f"finished/{r}")])]
        while time.monotonic() < deadline and not all(self._answered(r) for r in others):
            time.sleep(0.1)
        silent = [r for r in others if not self._answered(r)]
        what = (f"rank{'s' * (len(silent) > 1)} {', '.join(map(str, silent))} did not answer "
                f"(stopped or frozen: no stack from {'them' if len(silent) > 1 else 'it'})"
                if silent else "every rank answered: they wait on each other (a deadlock)")
        self._report_and_exit(f"the job is stuck: {why}; {what}; the stacks of every rank that "
                              f"answered are printed above, each under '[rank N] stacks'", silent)

    def _answered(self, rank: int) -> bool:
        return self.store.check([self._key(f"answered/{rank}")])

    def _answer(self) -> None:
        """Another rank claimed the hang: print this rank's stacks, say so, and end."""
        self._dump()
        self.store.set(self._key(f"answered/{self.rank}"), "1")
        try:  # stay until the claiming rank has its report out (or gave up waiting), then go
            self.store.wait([self._key("done")], timedelta(seconds=ANSWER_WAIT + 10))
        finally:
            _exit(1)

    def _report_and_exit(self, message: str, silent: list[int] = ()) -> None:
        self._dump()
        self.on_hang(message)
        # under torchrun (end_silent) a stopped rank on this machine is ended here: its agent
        # would give it 30 s to take a SIGTERM it cannot; distkit's launcher ends it itself,
        # and would report that SIGKILL as the job's first failure
        for rank in silent if self.end_silent else ():
            host, pid = self.store.get(self._key(f"pid/{rank}")).decode().split()
            if host == socket.gethostname():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except OSError:
                    pass
        self.store.set(self._key("done"), "1")
        _exit(1)

    def _dump(self) -> None:
        print(f"[rank {self.rank}] stacks (every thread) when the job stopped making progress:",
              file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)


def _exit(status: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def start(rank: int, world_size: int, timeout: float | None, on_hang: Callable[[str], None],
          end_silent: bool = False) -> Watchdog | None:
    """A running watchdog for this rank, or None when ``timeout`` is 0 or None (off)."""
    if not timeout:
        return None
    return Watchdog(rank, world_size, timeout, on_hang, end_silent).start()
