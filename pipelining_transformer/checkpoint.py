"""Checkpoints that do not care how the model was split (``torch.distributed.checkpoint``): every rank
saves its stages by the full model's parameter names, the progress and its random state into ``step_<N>/``
(keys: docs/pipelining_transformer_train.md); complete once rank 0 has written ``COMPLETE`` with every file's size.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from pipelining_transformer.model import ModelArgs, Transformer

log = logging.getLogger(__name__)

COMPLETE = "COMPLETE"
STEP_DIR = re.compile(r"step_(\d+)")
# what each --optimizer keeps per parameter (AdamW without amsgrad)
OPTIMIZER_KEYS = {"adamw": {"step", "exp_avg", "exp_avg_sq"}, "sgd": {"momentum_buffer"}}
BY_NAME = StateDictOptions(flatten_optimizer_state_dict=True)  # optimizer state by name: any split loads it
DATA_FLAGS = ("seed", "batch_size", "seq_len", "vocab_size")  # with the step: which batch comes next
Parts = Iterable[tuple[torch.nn.Module, torch.optim.Optimizer]]  # modules (full-model names), optimizers


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step_{step}"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _device(parts: list) -> torch.device:
    return next(p.device for module, _ in parts for p in module.parameters())


def _state(parts: list, step: int, data: Mapping[str, int], layout: str | None = None) -> tuple[dict, list]:
    """What ``save`` writes, and each part's state dicts: by parameter name (DTensors with --dp_size),
    an optimizer that has not stepped given its state, room for what a load brings."""
    dicts = [get_state_dict(module, opt, options=BY_NAME) for module, opt in parts]
    state = {"model": {k: v for part_model, _ in dicts for k, v in part_model.items()},
             "optim": {k: v for _, part_optim in dicts for k, v in part_optim.items()},
             "progress": {"step": torch.tensor(step), **{k: torch.tensor(v) for k, v in data.items()}}}
    if layout is not None:
        # keyed by rank (DCP keeps one copy of a key several ranks save): the CPU's and the GPU's
        device, rng = _device(parts), {"cpu": torch.get_rng_state()}
        if device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(device)
        state["rng"] = {"layout": layout, f"rank_{_rank()}": rng}
    return state, dicts


def save(root: str | os.PathLike, step: int, parts: Parts, data: Mapping[str, int],
         layout: str | None = None) -> Path:
    """Every rank calls this after optimizer step ``step``; returns the checkpoint's directory.
    ``data``: each of DATA_FLAGS; with a ``layout`` (world size, schedule, ...) the random state."""
    path = step_dir(root, step)
    if _rank() == 0:
        # a half-written step_<N> from a crashed run: nothing of it may survive into this one
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
    if _distributed():
        dist.barrier()
    dcp.save(_state(list(parts), step, data, layout)[0], checkpoint_id=path)
    if _distributed():
        dist.barrier()  # every rank's files are written before the checkpoint is called complete
    if _rank() == 0:
        # a kill (of any rank) before this point leaves no marker: the directory is skipped
        files = {f.name: f.stat().st_size for f in sorted(path.iterdir()) if f.is_file()}
        tmp = path / f"{COMPLETE}.tmp"
        with open(tmp, "w") as f:
            f.write(json.dumps({"step": step, "files": files}, indent=1))
            f.flush()
            os.fsync(f.fileno())  # DCP fsyncs its files; the marker must not reach disk first
        os.replace(tmp, path / COMPLETE)  # atomic: the marker is there whole or not at all
    return path


def why(error: BaseException) -> str:
    """An exception as a few words on one line: error messages here stay one line."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:120]}" if text else type(error).__name__


def problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` is not a complete checkpoint, or None."""
    path = Path(path)
    if not path.is_dir():
        return "no such directory"
    try:
        manifest = json.loads((path / COMPLETE).read_text())
    except FileNotFoundError:
        return f"no {COMPLETE} marker: its save never finished"
    except ValueError:  # not JSON, or not UTF-8
        return f"its {COMPLETE} marker is damaged"
    # valid JSON is not yet a marker that save() wrote: check its shape before trusting it
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not (isinstance(files, dict) and isinstance(manifest.get("step"), int)
            and all(isinstance(size, int) for size in files.values())):
        return f"its {COMPLETE} marker is damaged (no step or no file sizes)"
    if ".metadata" not in files:
        return f"its {COMPLETE} marker does not list .metadata"
    for name, size in files.items():
        if not (path / name).is_file():
            return f"{name} is missing"
        if (path / name).stat().st_size != size:
            return f"{name} is truncated ({(path / name).stat().st_size} of {size} bytes)"
    try:  # the right size does not make it readable, and a damaged .metadata fails every load
        _metadata(path)
    except Exception as e:  # unpickling a damaged file can raise almost anything
        return f"its .metadata cannot be read ({why(e)})"
    return None


def latest_complete(root: str | os.PathLike) -> Path | None:
    """The complete checkpoint of the highest step under ``root``; incomplete ones are skipped."""
    steps = sorted(((int(m.group(1)), d) for d in Path(root).glob("step_*")
                    if d.is_dir() and (m := STEP_DIR.fullmatch(d.name))), reverse=True)
    for _, d in steps:
        if (why := problem(d)) is None:
            return d
        log.warning(f"skipping {d}: {why}")
    return None


def _metadata(path: str | os.PathLike) -> dict:
    return dcp.FileSystemReader(path).read_metadata().state_dict_metadata


def incompatibility(path: str | os.PathLike, model_args: ModelArgs, optimizer: str,
                    data: Mapping[str, int]) -> str | None:
    """Why the checkpoint at ``path`` cannot load into this model and optimizer, or go on with
    this data stream (``data``: each of DATA_FLAGS), or None."""
    try:
        saved = _metadata(path)
    except Exception as e:  # unpickling a damaged file can raise almost anything
        return f"its .metadata cannot be read ({why(e)})"
    if missing := [f"--{flag}" for flag in DATA_FLAGS if f"progress.{flag}" not in saved]:
        return f"it does not record its data settings ({', '.join(missing)})"
    state = {"progress": {flag: torch.tensor(0) for flag in DATA_FLAGS}}  # only these load
    try:  # a local read before any process group: no warning on stderr, where a refusal is one line
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.load(state, checkpoint_id=path, no_dist=True)
    except Exception as e:
        return f"its data settings cannot be read ({why(e)})"
    was = {flag: int(v) for flag, v in state["progress"].items()}
    # checked before the shapes, so that another --vocab_size is named as such
    if differ := [flag for flag in DATA_FLAGS if was[flag] != data[flag]]:
        return (f"it was saved with {' '.join(f'--{f} {was[f]}' for f in differ)}, not "
                f"{' '.join(f'--{f} {data[f]}' for f in differ)} (another data stream)")
    with torch.device("meta"):
        model = Transformer(model_args)
    for name, p in model.named_parameters():
        meta = saved.get(f"model.{name}")
        if not isinstance(meta, TensorStorageMetadata):
            return f"it has no {name}"
        if tuple(meta.size) != tuple(p.shape):
            return f"its {name} is {tuple(meta.size)}, this model's is {tuple(p.shape)}"
        prefix = f"optim.state.{name}."
        keys = {k.removeprefix(prefix) for k in saved if k.startswith(prefix)}
        if keys and keys != OPTIMIZER_KEYS[optimizer]:
            return f"its optimizer state ({', '.join(sorted(keys))}) is not --optimizer {optimizer}'s"
    return None


def load(path: str | os.PathLike, parts: Parts, layout: str | None = None) -> int:
    """Load ``parts``' weights and optimizer state; return the step saved. With a ``layout``, the
    random state if saved in it, else a seed from (seed, step, rank). Needs no process group."""
    parts = list(parts)
    saved = _metadata(path)
    state, dicts = _state(parts, 0, {})  # room for every tensor, under the saved keys
    if layout is not None and "progress.seed" in saved:
        state["progress"]["seed"] = torch.tensor(0)
    mine = f"rng.rank_{_rank()}."
    if layout is not None and "rng.layout" in saved:
        state["rng"] = {"layout": "", f"rank_{_rank()}": {
            k.removeprefix(mine): torch.empty(m.size, dtype=m.properties.dtype)
            for k, m in saved.items() if k.startswith(mine)}}
    dcp.load(state, checkpoint_id=path)
    for (module, opt), (part_model, part_optim) in zip(parts, dicts):
        # each part takes its own keys, from ``state``: dcp.load put the hyper-parameters there
        set_state_dict(module, opt, options=BY_NAME,
                       model_state_dict={k: state["model"][k] for k in part_model},
                       optim_state_dict={k: state["optim"][k] for k in part_optim})
    step = int(state["progress"]["step"])
    if layout is None:  # not a resume of training (a model loaded to look at): RNG untouched
        return step
    rng = state.get("rng", {})
    mine = rng.get(f"rank_{_rank()}", {})
    if rng.get("layout") == layout and "cpu" in mine:
        torch.set_rng_state(mine["cpu"])
        if (device := _device(parts)).type == "cuda":
            torch.cuda.set_rng_state(mine["cuda"], device)
        log.info("random state restored: the same layout saved it")
    else:
        # another layout draws other masks anyway: fresh, but reproducible and not step 0's
        seed = int(state["progress"].get("seed", 0))
        torch.manual_seed((seed * 1_000_003 + step) * 1_009 + _rank())
        why = f"saved by layout {rng['layout']!r}" if rng.get("layout") else "none saved"
        log.info(f"random state not restored ({why}): seeded from the seed, step and rank")
    return step
