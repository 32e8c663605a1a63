"""Checkpoints that do not care how the model was split: ``torch.distributed.checkpoint``.

Each rank saves what its stages hold under the full model's names, in one directory per
step (``step_<N>/``)::

    model.<param name>            the weights                  ("model.layers.5.linear1.weight")
    optim.<param name>.<key>      that parameter's optimizer state (AdamW: step, exp_avg,
                                  exp_avg_sq; SGD: momentum_buffer)
    progress.step                 optimizer steps taken = index of the next batch to read

Because nothing in the keys says which stage or rank wrote them, any split (2 stages, 4
stages, one process with the whole ``Transformer``) loads any checkpoint: each process asks
for the keys of the parameters it holds. A checkpoint counts only once rank 0 has written
``COMPLETE`` (after a barrier, so after every rank's files are on disk); the marker lists
every file and its size, so a directory cut short by a crash, or a file truncated since,
is refused instead of loaded.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from pipelining_transformer.model import ModelArgs, Transformer

log = logging.getLogger(__name__)

COMPLETE = "COMPLETE"
STEP_DIR = re.compile(r"step_(\d+)")
# what each --optimizer keeps per parameter (AdamW without amsgrad)
OPTIMIZER_KEYS = {"adamw": {"step", "exp_avg", "exp_avg_sq"}, "sgd": {"momentum_buffer"}}

# one part = a module whose parameter names are the full model's, and its optimizer
Parts = Iterable[tuple[nn.Module, torch.optim.Optimizer]]


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step_{step}"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _state(parts: Parts, step: int) -> dict:
    model, optim = {}, {}
    for module, opt in parts:
        for name, p in module.named_parameters():
            model[name] = p.detach()
            # optimizer state on the CPU: a checkpoint does not depend on the device either
            optim[name] = {k: v.detach().cpu() for k, v in opt.state.get(p, {}).items()
                           if isinstance(v, torch.Tensor)}
    return {"model": model, "optim": optim, "progress": {"step": torch.tensor(step)}}


def save(root: str | os.PathLike, step: int, parts: Parts) -> Path:
    """Every rank calls this after optimizer step ``step``; returns the checkpoint's directory."""
    path = step_dir(root, step)
    rank0 = not _distributed() or dist.get_rank() == 0
    if rank0:
        # a half-written step_<N> from a crashed run: nothing of it may survive into this one
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
    if _distributed():
        dist.barrier()
    dcp.save(_state(parts, step), checkpoint_id=path)
    if _distributed():
        dist.barrier()  # every rank's files are written before the checkpoint is called complete
    if rank0:
        files = {f.name: f.stat().st_size for f in sorted(path.iterdir()) if f.is_file()}
        tmp = path / f"{COMPLETE}.tmp"
        tmp.write_text(json.dumps({"step": step, "files": files}, indent=1))
        os.replace(tmp, path / COMPLETE)  # atomic: the marker is there whole or not at all
    return path


def problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` is not a complete checkpoint, or None."""
    path = Path(path)
    if not path.is_dir():
        return "no such directory"
    try:
        manifest = json.loads((path / COMPLETE).read_text())
    except FileNotFoundError:
        return f"no {COMPLETE} marker: its save never finished"
    except ValueError:
        return f"its {COMPLETE} marker is damaged"
    for name, size in manifest["files"].items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} is truncated ({f.stat().st_size} of {size} bytes)"
    return None


def latest_complete(root: str | os.PathLike) -> Path | None:
    """The complete checkpoint of the highest step under ``root``; incomplete ones are skipped."""
    root = Path(root)
    steps = sorted(((int(m.group(1)), d) for d in root.glob("step_*")
                    if d.is_dir() and (m := STEP_DIR.fullmatch(d.name))), reverse=True)
    for _, d in steps:
        why = problem(d)
        if why is None:
            return d
        log.warning(f"skipping {d}: {why}")
    return None


def _metadata(path: Path) -> dict:
    return dcp.FileSystemReader(path).read_metadata().state_dict_metadata


def incompatibility(path: str | os.PathLike, model_args: ModelArgs, optimizer: str) -> str | None:
    """Why the checkpoint at ``path`` cannot load into this model and optimizer, or None."""
    saved = _metadata(Path(path))
    with torch.device("meta"):
        model = Transformer(model_args)
    for name, p in model.named_parameters():
        meta = saved.get(f"model.{name}")
        if not isinstance(meta, TensorStorageMetadata):
            return f"it has no {name}"
        if tuple(meta.size) != tuple(p.shape):
            return f"its {name} is {tuple(meta.size)}, this model's is {tuple(p.shape)}"
        keys = {k.removeprefix(f"optim.{name}.") for k in saved if k.startswith(f"optim.{name}.")}
        if keys and keys != OPTIMIZER_KEYS[optimizer]:
            return f"its optimizer state ({', '.join(sorted(keys))}) is not --optimizer {optimizer}'s"
    return None


def load(path: str | os.PathLike, parts: Parts) -> int:
    """Load the weights and optimizer state of ``parts``' parameters; return the step saved.

    Works in a process group (every rank calls it) and in a plain process without one.
    """
    path = Path(path)
    parts = list(parts)
    saved = _metadata(path)
    state = _state(parts, 0)  # the weights load in place, into the parameters themselves
    for module, _ in parts:
        for name, _ in module.named_parameters():
            # optimizers create their state lazily: make room for what the checkpoint has
            prefix = f"optim.{name}."
            state["optim"][name] = {
                k.removeprefix(prefix): torch.empty(m.size, dtype=m.properties.dtype)
                for k, m in saved.items() if k.startswith(prefix)}
    dcp.load(state, checkpoint_id=path)
    for module, opt in parts:
        for name, p in module.named_parameters():
            if state["optim"][name]:
                # AdamW keeps its step count on the CPU unless capturable; the rest by the weight
                opt.state[p] = {k: v if k == "step" else v.to(p.device)
                                for k, v in state["optim"][name].items()}
    return int(state["progress"]["step"])
