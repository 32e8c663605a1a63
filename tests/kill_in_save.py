"""pipelining_transformer/train.py with a crash in the middle of a checkpoint write (for tests).

Run under torchrun in place of train.py. On torchrun's first attempt, rank $KILL_RANK
SIGKILLs itself inside ``checkpoint.save`` of step $KILL_STEP, once ``dcp.save`` has returned
(every rank's files and ``.metadata`` are on disk: DCP alone would load it) but before the
``COMPLETE`` marker is written. Restarted workers run train.py unchanged.
"""
from __future__ import annotations

import os
import signal
import sys

from pipelining_transformer import checkpoint
from pipelining_transformer.train import main


def _install() -> None:
    step, rank = int(os.environ["KILL_STEP"]), os.environ.get("KILL_RANK", "0")
    if os.environ.get("TORCHELASTIC_RESTART_COUNT") != "0" or os.environ["RANK"] != rank:
        return
    save = checkpoint.dcp.save

    def save_then_die(state: dict, **kwargs):
        result = save(state, **kwargs)
        if int(state["progress"]["step"]) == step:
            print(f"kill_in_save: rank {rank} dies after dcp.save of step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    checkpoint.dcp.save = save_then_die  # this process only: torch's module, patched here


if __name__ == "__main__":
    _install()
    sys.exit(main())
