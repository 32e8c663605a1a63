"""``--hang_timeout``: a job that stops making progress ends, with every rank's Python stack.

Progress (a module's forward, an optimizer step: PyTorch's global hooks) goes to a counter in the
job's store, and each rank's heartbeat to a key only it writes. After ``hang_timeout`` s without any
progress, or without a peer's heartbeat, every live rank prints its own ``faulthandler`` stack, names
the ranks whose heartbeat stopped, and exits; nothing reads a process id from the store or kills one
(the launcher ends a stopped rank: docs/failures.md). Why our own: PyTorch bounds one call, not a
rank stopped between calls, and torchrun's file timer bounds what a rank opens itself, with no stack.
A guard thread ends the rank when the watchdog's store call hangs or it raised, and keeps
``faulthandler``'s timer from ending a rank whose interpreter is frozen (the GIL held), and
torchrun's file timer, if on, from killing it.
"""
from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_hook
from torch.distributed.elastic.timer import FileTimerClient
from torch.optim.optimizer import register_optimizer_step_post_hook

from .rendezvous import STORE_TIMEOUT, connect, restart_key

PEER_WAIT = 5.0  # seconds a rank that saw the hang waits for its live peers' stacks before it exits
# A rank frozen whole is ended (faulthandler, its launcher, torchrun's file timer) this long after
# --hang_timeout: time for its peers to name it first (waiting PEER_WAIT for each other's stacks)
TIMER_MARGIN = PEER_WAIT + 10
TIMER_SCOPE = "distkit-watchdog"
STORE_FLOOR = 10.0  # seconds: the least time a store call gets before the store counts as lost
TIMER_FILE = "TORCHELASTIC_TIMER_FILE"  # set by torchrun's agent with TORCHELASTIC_ENABLE_FILE_TIMER=1


class Watchdog:
    """Lives in every rank: counts this rank's progress, publishes it, watches the job's."""

    def __init__(self, rank: int, world_size: int, timeout: float, on_hang: Callable[[str], None]) -> None:
        self.rank, self.world_size, self.timeout, self.on_hang = rank, world_size, timeout, on_hang
        self.interval = min(1.0, max(0.05, timeout / 10))
        self.ticks = 0  # bumped by the hooks, read by the thread: any change is progress
        self._stop = threading.Event()
        self._hooks: list[Any] = []
        self._deadline, self._since = float("inf"), time.monotonic()  # the thread's store call, by then
        self.store_bound = max(timeout, STORE_FLOOR)  # a loaded machine's slow moment is no lost store
        self._ending = threading.Lock()  # one report per rank, whichever thread ends it
        self.timer = FileTimerClient(os.environ[TIMER_FILE]) if os.environ.get(TIMER_FILE) else None
        self.store = connect(max(STORE_TIMEOUT, timedelta(seconds=timeout)))  # rank 0 may be starting it
        self.prefix = f"distkit/watchdog/{restart_key()}"

    def tick(self, *_: Any) -> None:
        if not torch.compiler.is_compiling():  # the tracer split exports the model
            self.ticks += 1

    def start(self) -> Watchdog:
        self._hooks = [register_module_forward_hook(self.tick), register_optimizer_step_post_hook(self.tick)]
        self.store.add(f"{self.prefix}alive/{self.rank}", 1)  # now: a rank frozen at once is no late start
        threading.Thread(target=self._watch, name="distkit-watchdog", daemon=True).start()
        threading.Thread(target=self._guard, name="distkit-watchdog-guard", daemon=True).start()
        return self

    def stop(self) -> None:
        """This rank is done: the others stop expecting its heartbeat."""
        self._expect(self.store_bound)  # the guard still bounds this last store call
        with contextlib.suppress(Exception):
            self.store.set(f"{self.prefix}finished/{self.rank}", "1")
        self._stop.set()
        if self.timer is not None:
            with contextlib.suppress(Exception):  # the timer's server is gone: no timer of ours to fire
                self.timer.release(TIMER_SCOPE)
        for hook in self._hooks:
            hook.remove()

    def _expect(self, seconds: float) -> None:
        """The watchdog thread's store calls until the next ``_expect`` take at most ``seconds``."""
        self._since = time.monotonic()
        self._deadline = self._since + seconds

    def _guard(self) -> None:
        """Ends the rank when the watchdog thread is stuck in a store call; keeps the timers."""
        try:
            while not self._stop.wait(self.interval):
                faulthandler.dump_traceback_later(self.timeout + TIMER_MARGIN, exit=True, file=sys.__stderr__)
                if self.timer is not None:
                    try:
                        self.timer.acquire(TIMER_SCOPE, time.time() + self.timeout + TIMER_MARGIN)
                    except Exception:
                        self.timer = None  # the launcher's timer server is gone; the store check stays
                now = time.monotonic()
                if now > self._deadline and self._ending.locked():
                    _exit(1)  # the rank's report is out; a store call after it is what hangs
                if now > self._deadline and not self._stop.is_set():
                    self._give_up(f"rank {self.rank}: the job's rendezvous store has not answered for "
                                  f"{now - self._since:.0f} s (--hang_timeout {self.timeout:g}): its host is "
                                  f"stopped, gone or cut off")
        finally:  # a watchdog stopped in-process (the tests') leaves no timer to end the process
            faulthandler.cancel_dump_traceback_later()

    def _watch(self) -> None:
        """The watchdog thread: whatever goes wrong in it ends the rank with a report."""
        published, last_total, last_change = 0, -1, time.monotonic()
        beats: dict[int, tuple[int, float]] = {}  # peer -> (heartbeat count, when it last moved)
        try:
            while not self._stop.wait(self.interval):
                self._expect(self.store_bound)
                if self.ticks != published:
                    published = self.ticks
                    self.store.add(f"{self.prefix}progress", 1)
                self.store.add(f"{self.prefix}alive/{self.rank}", 1)
                now = time.monotonic()
                total = self.store.add(f"{self.prefix}progress", 0)
                if total != last_total:
                    last_total, last_change = total, now
                # a peer whose heartbeat stopped is stopped or frozen, though others progress (ddp_rpc)
                for rank in self._peers():
                    beat = self.store.add(f"{self.prefix}alive/{rank}", 0)
                    if beat and beats.get(rank, (None,))[0] != beat:  # 0: not started (the rendezvous')
                        beats[rank] = (beat, now)
                silent = [r for r, (_, moved) in beats.items() if now - moved > self.timeout
                          and not self.store.check([f"{self.prefix}finished/{r}"])]
                # until the job's first progress, start-up gets the store's bound
                bound = self.timeout if total > 0 else max(self.timeout, STORE_TIMEOUT.total_seconds())
                if silent or now - last_change > bound:
                    return self._report(silent, now - last_change)
        except Exception as e:  # the store is gone, a key missing, a peer's entry unreadable
            if not self._stop.is_set():
                self._give_up(f"rank {self.rank}: the hang watchdog failed ({type(e).__name__}: {e}), "
                              f"so it cannot watch the job")

    def _peers(self) -> list[int]:
        return [r for r in range(self.world_size) if r != self.rank]

    def _report(self, silent: list[int], idle: float) -> None:
        """This rank saw the job stop: its stack, then a short wait for every live peer's, and the report."""
        self._ending.acquire()  # one report: the guard stays quiet from here
        self._expect(self.store_bound + PEER_WAIT)
        self._dump()
        try:  # each rank writes only its own key: "my stack is out"
            self.store.set(f"{self.prefix}stacked/{self.rank}", "1")
            live = [f"{self.prefix}stacked/{r}" for r in self._peers() if r not in silent
                    and not self.store.check([f"{self.prefix}finished/{r}"])]
            deadline = time.monotonic() + PEER_WAIT
            while live and not self.store.check(live) and time.monotonic() < deadline:
                time.sleep(0.1)
        except Exception:
            pass  # the store may be what failed: the report goes out regardless
        if silent:
            them = "them" if len(silent) > 1 else "it"
            why = (f"rank{'s' * (len(silent) > 1)} {', '.join(map(str, silent))} stopped answering (no heartbeat "
                   f"for over --hang_timeout {self.timeout:g} s: stopped or frozen, no stack from {them})")
        else:
            why = (f"no progress in {idle:.0f} s (--hang_timeout {self.timeout:g}) on any of the {self.world_size} "
                   f"ranks; every rank answered: they wait on each other (a deadlock)")
        self.on_hang(f"the job is stuck: {why}; the stacks of every rank that answered are printed above, "
                     f"each under '[rank N] stacks'")
        _exit(1)

    def _give_up(self, message: str) -> None:
        """This rank's stack and ``message``, then exit 1, touching nothing that can block."""
        if not self._ending.acquire(blocking=False):
            return  # the other thread is ending the rank with its own report
        self._dump()
        self.on_hang(f"{message}; this rank's stack is printed above")
        _exit(1)

    def _dump(self) -> None:
        print(f"[rank {self.rank}] stacks (every thread) when the job stopped making progress:",
              file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)


def _exit(status: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
