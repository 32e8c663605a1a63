"""``--hang_timeout``: a job that stops making progress ends, with every rank's Python stack.

Progress (a module's forward, an optimizer step: PyTorch's global hooks) goes to a counter in the
job's store, and each rank's heartbeat to a key only it writes. After ``hang_timeout`` s without any
progress, or without a peer's heartbeat, every live rank prints its own ``faulthandler`` stack, names
the ranks whose heartbeat stopped, and exits; nothing reads a process id from the store or kills one
(a stopped rank is its launcher's to end: docs/failures.md). Why our own: PyTorch bounds one call,
not a rank stopped between calls, and torchrun's file timer bounds what a rank opens itself, with no
stack. Each round's store calls run on a helper thread joined with a bound, since a store call waits
on a stopped store host for ever (TCPStore's timeout bounds neither ``add`` nor ``check``); and each
round re-arms ``faulthandler``'s C timer, which ends a rank whose interpreter is frozen (the GIL held).
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
from torch.optim.optimizer import register_optimizer_step_post_hook

from .rendezvous import STORE_TIMEOUT, connect, restart_key

PEER_WAIT = 5.0  # seconds a rank that saw the hang waits for its live peers' stacks before it exits
# A rank frozen whole (the GIL held) is ended by faulthandler this long after --hang_timeout: time for
# its peers to name it first (waiting PEER_WAIT for each other's stacks)
TIMER_MARGIN = PEER_WAIT + 10
STORE_FLOOR = 10.0  # seconds: the least time a store call gets before the store counts as lost


class StoreLost(Exception):
    """The job's store did not answer within the bound."""


class Watchdog:
    """Lives in every rank: counts this rank's progress, publishes it, watches the job's."""

    def __init__(self, rank: int, world_size: int, timeout: float, on_hang: Callable[[str], None]) -> None:
        self.rank, self.world_size, self.timeout, self.on_hang = rank, world_size, timeout, on_hang
        self.interval = min(1.0, max(0.05, timeout / 10))
        self.ticks = 0  # bumped by the hooks, read by the thread: any change is progress
        self._stop = threading.Event()
        self._hooks: list[Any] = []
        self.store_bound = max(timeout, STORE_FLOOR)  # a loaded machine's slow moment is no lost store
        self._ending = threading.Lock()  # one report per rank, whichever thread ends it
        self.store = connect(max(STORE_TIMEOUT, timedelta(seconds=timeout)))  # rank 0 may be starting it
        self.prefix = f"distkit/watchdog/{restart_key()}"

    def tick(self, *_: Any) -> None:
        if not torch.compiler.is_compiling():  # the tracer split exports the model
            self.ticks += 1

    def start(self) -> Watchdog:
        self._hooks = [register_module_forward_hook(self.tick), register_optimizer_step_post_hook(self.tick)]
        self.store.add(f"{self.prefix}alive/{self.rank}", 1)  # now: a rank frozen at once is no late start
        threading.Thread(target=self._watch, name="distkit-watchdog", daemon=True).start()
        return self

    def stop(self) -> None:
        """This rank is done: the others stop expecting its heartbeat."""
        try:
            self._bounded(lambda: self.store.set(f"{self.prefix}finished/{self.rank}", "1"))
        except StoreLost as e:
            self._give_up(str(e))
        except Exception:
            pass
        self._stop.set()
        for hook in self._hooks:
            hook.remove()

    def _bounded(self, work: Callable[[], Any], seconds: float | None = None) -> Any:
        """``work()`` on a helper thread, joined for ``seconds`` (the store's bound); ``StoreLost`` past it."""
        seconds = self.store_bound if seconds is None else seconds
        out: dict[str, Any] = {}

        def run() -> None:
            try:
                out["value"] = work()
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                out["error"] = e

        helper = threading.Thread(target=run, name="distkit-watchdog-store", daemon=True)
        helper.start()
        helper.join(seconds)
        if helper.is_alive():
            raise StoreLost(f"rank {self.rank}: the job's rendezvous store has not answered for {seconds:.0f} s "
                            f"(--hang_timeout {self.timeout:g}): its host is stopped, gone or cut off")
        if "error" in out:
            raise out["error"]
        return out.get("value")

    def _watch(self) -> None:
        """The watchdog thread: whatever goes wrong in it ends the rank with a report."""
        published, last_total, last_change = 0, -1, time.monotonic()
        beats: dict[int, tuple[int, float]] = {}  # peer -> (heartbeat count, when it last moved)

        def look() -> tuple[list[int], int]:
            """One round's store work: publish this rank's progress and heartbeat, read the job's."""
            nonlocal published
            if self.ticks != published:
                published = self.ticks
                self.store.add(f"{self.prefix}progress", 1)
            self.store.add(f"{self.prefix}alive/{self.rank}", 1)
            now = time.monotonic()
            # a peer whose heartbeat stopped is stopped or frozen, though others progress (ddp_rpc)
            for rank in self._peers():
                beat = self.store.add(f"{self.prefix}alive/{rank}", 0)
                if beat and beats.get(rank, (None,))[0] != beat:  # 0: not started (the rendezvous')
                    beats[rank] = (beat, now)
            silent = [r for r, (_, moved) in beats.items() if now - moved > self.timeout
                      and not self.store.check([f"{self.prefix}finished/{r}"])]
            return silent, self.store.add(f"{self.prefix}progress", 0)

        try:
            while not self._stop.wait(self.interval):
                # renewed while this thread runs: only a frozen interpreter lets it fire
                faulthandler.dump_traceback_later(self.timeout + TIMER_MARGIN, exit=True, file=sys.__stderr__)
                silent, total = self._bounded(look)
                now = time.monotonic()
                if total != last_total:
                    last_total, last_change = total, now
                # until the job's first progress, start-up gets the store's bound
                bound = self.timeout if total > 0 else max(self.timeout, STORE_TIMEOUT.total_seconds())
                if silent or now - last_change > bound:
                    return self._report(silent, now - last_change)
        except StoreLost as e:
            if not self._stop.is_set():
                self._give_up(str(e))
        except Exception as e:  # the store is gone, a key missing, a peer's entry unreadable
            if not self._stop.is_set():
                self._give_up(f"rank {self.rank}: the hang watchdog failed ({type(e).__name__}: {e}), "
                              f"so it cannot watch the job")
        finally:  # a watchdog stopped in-process (the tests') leaves no timer to end the process
            faulthandler.cancel_dump_traceback_later()

    def _peers(self) -> list[int]:
        return [r for r in range(self.world_size) if r != self.rank]

    def _report(self, silent: list[int], idle: float) -> None:
        """This rank saw the job stop: its stack, then a short wait for every live peer's, and the report
        (also when the store stops answering meanwhile)."""
        self._ending.acquire()  # one report: a failing store call in stop() stays quiet from here
        faulthandler.cancel_dump_traceback_later()  # the wait below is bounded: this thread ends the rank
        self._dump()

        def wait_for_peers() -> None:  # each rank writes only its own key: "my stack is out"
            self.store.set(f"{self.prefix}stacked/{self.rank}", "1")
            live = [f"{self.prefix}stacked/{r}" for r in self._peers() if r not in silent
                    and not self.store.check([f"{self.prefix}finished/{r}"])]
            deadline = time.monotonic() + PEER_WAIT
            while live and not self.store.check(live) and time.monotonic() < deadline:
                time.sleep(0.1)

        with contextlib.suppress(Exception):  # the store may be what failed: the report goes out regardless
            self._bounded(wait_for_peers, PEER_WAIT + self.interval)
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
        faulthandler.cancel_dump_traceback_later()
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
