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

The watchdog cannot die quietly: a second thread (the guard) ends the rank, with its stack
and the reason, when the watchdog thread's store call has not returned in time (the store's
host frozen or cut off: a TCPStore call would wait for its client's timeout) or the thread
raised. The guard also renews that file timer where the launcher runs its server (distkit's
always, torchrun's with ``TORCHELASTIC_ENABLE_FILE_TIMER=1``): a rank frozen whole, alone on
its machine, is then killed by its own launcher, which nothing on another machine can do.
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
from torch.distributed.elastic.timer import FileTimerClient
from torch.optim.optimizer import register_optimizer_step_post_hook

from .rendezvous import STORE_TIMEOUT, connect, restart_key

ANSWER_WAIT = 5.0  # seconds the claiming rank waits for the others' stacks
# A rank frozen whole (SIGSTOP, a machine that stops) is killed by its launcher's file timer
# this long after --hang_timeout: time for a rank on another machine to claim the hang and
# report it first (it waits ANSWER_WAIT for the frozen rank's stack).
TIMER_MARGIN = ANSWER_WAIT + 10
TIMER_SCOPE = "distkit-watchdog"
STORE_FLOOR = 10.0  # seconds: the least time a store call gets before the store counts as lost
# set by torchrun's agent when TORCHELASTIC_ENABLE_FILE_TIMER=1, and always by distkit's launcher
TIMER_FILE = "TORCHELASTIC_TIMER_FILE"


def machine() -> str:
    """This process's machine, as a peer on the same machine would name it: the host name,
    and the PID namespace (processes in another one, a container, do not share our pids)."""
    try:
        return f"{socket.gethostname()}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return socket.gethostname()


class Watchdog:
    """Lives in every rank: counts this rank's progress, publishes it, watches the job's."""

    def __init__(self, rank: int, world_size: int, timeout: float,
                 on_hang: Callable[[str], None]) -> None:
        self.rank, self.world_size, self.timeout, self.on_hang = rank, world_size, timeout, on_hang
        self.interval = min(1.0, max(0.05, timeout / 10))
        self.ticks = 0  # bumped by the hooks, read by the thread: any change is progress
        self._stop = threading.Event()
        self._hooks: list[Any] = []
        # the watchdog thread's next store call must have returned by then (monotonic); the
        # guard thread ends the rank with its report when it has not: the store's host is
        # frozen or gone, and a TCPStore call to a frozen host waits for the client's timeout
        self._deadline, self._since = float("inf"), time.monotonic()
        # a store call may take this long before the store counts as lost: --hang_timeout,
        # but not under 10 s, so that a slow moment of a loaded machine is not a lost store
        self.store_bound = max(timeout, STORE_FLOOR)
        self._ending = threading.Lock()  # one report per rank, whichever thread ends it
        # under a launcher with a file timer, the guard keeps a timer going that the
        # launcher's server ends this process with if the whole process stops (SIGSTOP)
        self.timer = FileTimerClient(os.environ[TIMER_FILE]) if os.environ.get(TIMER_FILE) else None
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
        self.store.set(self._key(f"pid/{self.rank}"), f"{machine()} {os.getpid()}")
        # the first heartbeat now, not an interval later: a rank frozen within its first
        # interval would otherwise read as "not started yet" and get start-up's long bound
        self.store.add(self._key(f"alive/{self.rank}"), 1)
        threading.Thread(target=self._run, name="distkit-watchdog", daemon=True).start()
        threading.Thread(target=self._guard, name="distkit-watchdog-guard", daemon=True).start()
        return self

    def stop(self) -> None:
        """This rank is done: the others stop expecting its heartbeat."""
        self._expect(self.store_bound)  # the guard still bounds this last store call
        try:
            self.store.set(self._key(f"finished/{self.rank}"), "1")
        except Exception:
            pass
        self._stop.set()
        if self.timer is not None:
            try:
                self.timer.release(TIMER_SCOPE)
            except Exception:
                pass  # the timer's server is gone: it has no timer of ours to fire
        for hook in self._hooks:
            hook.remove()

    def _expect(self, seconds: float) -> None:
        """The watchdog thread's store calls until the next ``_expect`` take at most ``seconds``."""
        self._since = time.monotonic()
        self._deadline = self._since + seconds

    def _guard(self) -> None:
        """Ends the rank when the watchdog thread is stuck in a store call; keeps the file timer."""
        while not self._stop.wait(self.interval):
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
                              f"{now - self._since:.0f} s (--hang_timeout {self.timeout:g}): its "
                              f"host is stopped, gone or cut off; this rank's stack is printed "
                              f"above")

    def _run(self) -> None:
        """The watchdog thread: whatever goes wrong in it ends the rank with a report."""
        try:
            self._watch()
        except Exception as e:  # the store is gone, a key missing, a peer's entry unreadable
            if not self._stop.is_set():
                self._give_up(f"rank {self.rank}: the hang watchdog failed ({type(e).__name__}: "
                              f"{e}), so it cannot watch the job; this rank's stack is printed "
                              f"above")

    def _watch(self) -> None:
        published, last_total, last_change = 0, -1, time.monotonic()
        armed = False  # until the job's first progress, start-up gets the store's bound
        beats: dict[int, tuple[int, float]] = {}  # rank -> (heartbeat count, when it last moved)
        while not self._stop.wait(self.interval):
            self._expect(self.store_bound)
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

    def _claim(self, why: str) -> None:
        """The first rank here reports the hang and collects everyone's stacks."""
        self._expect(self.store_bound + ANSWER_WAIT)  # the others' stacks take a while
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
        self._ending.acquire()  # this rank's stack once: the guard stays quiet from here
        self._expect(self.store_bound + ANSWER_WAIT + 10)  # the wait below has a bound of its own
        self._dump()
        try:
            self.store.set(self._key(f"answered/{self.rank}"), "1")
            # stay until the claiming rank has its report out (or gave up waiting), then go
            self.store.wait([self._key("done")], timedelta(seconds=ANSWER_WAIT + 10))
        finally:  # the wait's own timeout, or the store gone: this rank ends all the same
            _exit(1)

    def _report_and_exit(self, message: str, silent: list[int] = ()) -> None:
        self._ending.acquire()
        self._dump()
        self.on_hang(message)
        self._expect(self.store_bound)
        try:
            # a stopped rank on this machine is ended here: torchrun's agent and mp.spawn would
            # give it 30 s to take a SIGTERM it cannot (the launcher reports the hang, not this kill)
            for rank in silent:
                where, pid = self.store.get(self._key(f"pid/{rank}")).decode().rsplit(" ", 1)
                if where == machine():
                    os.kill(int(pid), signal.SIGKILL)
            self.store.set(self._key("done"), "1")
        except Exception:
            pass  # the report is out; the store may be what failed: the rank ends regardless
        finally:
            _exit(1)

    def _give_up(self, message: str) -> None:
        """This rank's stack and ``message``, then exit 1, touching nothing that can block."""
        if not self._ending.acquire(blocking=False):
            return  # the other thread is ending the rank with its own report
        self._dump()
        self.on_hang(message)
        _exit(1)

    def _dump(self) -> None:
        print(f"[rank {self.rank}] stacks (every thread) when the job stopped making progress:",
              file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)


def _exit(status: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def start(rank: int, world_size: int, timeout: float | None,
          on_hang: Callable[[str], None]) -> Watchdog | None:
    """A running watchdog for this rank, or None when ``timeout`` is 0 or None (off)."""
    if not timeout:
        return None
    return Watchdog(rank, world_size, timeout, on_hang).start()
