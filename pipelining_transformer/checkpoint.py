"""Checkpoints that do not care how the model was split: ``torch.distributed.checkpoint``.

Each rank saves what its stages hold under the full model's names, in one directory per
step (``step_<N>/``), as PyTorch's ``get_state_dict`` names it with
``flatten_optimizer_state_dict=True``::

    model.<param name>            the weights                  ("model.layers.5.linear1.weight")
    optim.state.<param name>.<key>  that parameter's optimizer state (AdamW: step, exp_avg,
                                  exp_avg_sq; SGD with momentum: momentum_buffer)
    optim.param_groups.<param name>.<key>  its hyper-parameters (lr, betas, ...)
    progress.step                 optimizer steps taken = index of the next batch to read
    progress.<flag>               the flags that fix the data stream (--seed, --batch_size,
                                  --seq_len, --vocab_size): with the step, the data position
    rng.layout                    the process layout that drew the random numbers
    rng.rank_<r>.cpu, .cuda       rank r's random state (CPU generator; CUDA where it trains
                                  on a GPU) after the step: what its next dropout masks are

No key names a stage or rank, so any split (one process with the whole ``Transformer``
too) loads any checkpoint. A checkpoint counts once rank 0 has written ``COMPLETE`` after
every rank's files: DCP's ``.metadata``-last commit says the save finished, and the marker
also lists every file's size, so a file truncated since is refused
(``test_truncated_or_unfinished_checkpoint_is_refused``). Random states go back only in the
layout that saved them (the same dropout masks); another layout seeds from (seed, step, rank).
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
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from pipelining_transformer.model import ModelArgs, Transformer

log = logging.getLogger(__name__)

COMPLETE = "COMPLETE"
STEP_DIR = re.compile(r"step_(\d+)")
# what each --optimizer keeps per parameter (AdamW without amsgrad)
OPTIMIZER_KEYS = {"adamw": {"step", "exp_avg", "exp_avg_sq"}, "sgd": {"momentum_buffer"}}
# the optimizer's state and hyper-parameters by parameter name, not by index: any split loads them
BY_NAME = StateDictOptions(flatten_optimizer_state_dict=True)
# the flags whose values, with the step, say which batch comes next (see synthetic_batch)
DATA_FLAGS = ("seed", "batch_size", "seq_len", "vocab_size")

# one part = a module whose parameter names are the full model's, and its optimizer
Parts = Iterable[tuple[nn.Module, torch.optim.Optimizer]]


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step_{step}"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """This process's random state: the CPU generator's, and the GPU's it trains on."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: Mapping[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def _device(parts: list) -> torch.device:
    return next(p.device for module, _ in parts for p in module.parameters())


def _state_dicts(parts: list) -> list[tuple[dict, dict]]:
    """Each part's model and optimizer state dicts by parameter name (DTensors with --dp_size);
    an optimizer that has not stepped gets its state made, room for what a load brings."""
    return [get_state_dict(module, opt, options=BY_NAME) for module, opt in parts]


def _state(parts: Parts, step: int, data: Mapping[str, int], layout: str | None = None,
           dicts: list[tuple[dict, dict]] | None = None) -> dict:
    """What ``save`` writes: the state dicts, the progress, with a ``layout`` the random state."""
    parts = list(parts)
    dicts = _state_dicts(parts) if dicts is None else dicts
    model = {k: v for part_model, _ in dicts for k, v in part_model.items()}
    optim = {k: v for _, part_optim in dicts for k, v in part_optim.items()}
    progress = {"step": torch.tensor(step), **{k: torch.tensor(v) for k, v in data.items()}}
    state = {"model": model, "optim": optim, "progress": progress}
    if layout is not None:
        # keyed by rank: DCP keeps one copy of a key that several ranks save
        state["rng"] = {"layout": layout, f"rank_{_rank()}": _rng_state(_device(parts))}
    return state


def save(root: str | os.PathLike, step: int, parts: Parts, data: Mapping[str, int],
         layout: str | None = None) -> Path:
    """Every rank calls this after optimizer step ``step``; returns the checkpoint's directory.
    ``data``: each of DATA_FLAGS; ``layout`` (world size, schedule, ...): with it every rank's
    random state is saved too, for a resume in the same layout."""
    path = step_dir(root, step)
    rank0 = not _distributed() or dist.get_rank() == 0
    if rank0:
        # a half-written step_<N> from a crashed run: nothing of it may survive into this one
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
    if _distributed():
        dist.barrier()
    dcp.save(_state(parts, step, data, layout), checkpoint_id=path)
    if _distributed():
        dist.barrier()  # every rank's files are written before the checkpoint is called complete
    if rank0:
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
    first = str(error).strip().splitlines()[0][:120] if str(error).strip() else ""
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


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
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} is truncated ({f.stat().st_size} of {size} bytes)"
    try:  # the right size does not make it readable, and a damaged .metadata fails every load
        _metadata(path)
    except Exception as e:  # unpickling a damaged file can raise almost anything
        return f"its .metadata cannot be read ({why(e)})"
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


def _saved_data(path: Path) -> dict[str, int]:
    """The DATA_FLAGS values the checkpoint at ``path`` was saved with (only those tensors load)."""
    state = {"progress": {flag: torch.tensor(0) for flag in DATA_FLAGS}}
    with warnings.catch_warnings():
        # a local read of four numbers, before any process group exists: not worth a warning
        # on stderr, where a refusal must be one line
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(state, checkpoint_id=path, no_dist=True)
    return {flag: int(v) for flag, v in state["progress"].items()}


def incompatibility(path: str | os.PathLike, model_args: ModelArgs, optimizer: str,
                    data: Mapping[str, int]) -> str | None:
    """Why the checkpoint at ``path`` cannot load into this model and optimizer, or cannot go
    on with this data stream (``data``: the value of each of DATA_FLAGS), or None."""
    path = Path(path)
    try:
        saved = _metadata(path)
    except Exception as e:  # unpickling a damaged file can raise almost anything
        return f"its .metadata cannot be read ({why(e)})"
    missing = [f"--{flag}" for flag in DATA_FLAGS if f"progress.{flag}" not in saved]
    if missing:
        return f"it does not record its data settings ({', '.join(missing)})"
    try:
        was = _saved_data(path)
    except Exception as e:
        return f"its data settings cannot be read ({why(e)})"
    # checked before the shapes, so that another --vocab_size is named as such
    differ = [flag for flag in DATA_FLAGS if was[flag] != data[flag]]
    if differ:
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


def resume_path(resume: str | None, root: str | None, model_args: ModelArgs, optimizer: str,
                data: Mapping[str, int]) -> str | None:
    """The checkpoint ``--resume`` names (``"latest"``: the newest complete one under ``root``,
    or None), once checked; ValueError (one line) if it cannot load."""
    if resume is None:
        return None
    path = latest_complete(root) if resume == "latest" else resume
    if path is None:
        return None
    why = problem(path) if resume != "latest" else None
    why = why or incompatibility(path, model_args, optimizer, data)
    if why:
        raise ValueError(f"cannot resume from {path}: {why}")
    return str(path)


def same_on_every_rank(path: str | None) -> str | None:
    """``path``, once every rank has checked it chose the same one: each picks the newest
    itself, and a file system that shows a marker to one machine first would otherwise
    let ranks resume from different steps, silently wrong."""
    if not _distributed():
        return path
    chosen: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(chosen, path)
    if len(set(chosen)) > 1:
        raise RuntimeError("the ranks chose different checkpoints to resume from: " +
                           ", ".join(f"rank {r}: {p}" for r, p in enumerate(chosen)))
    return path


def load(path: str | os.PathLike, parts: Parts, layout: str | None = None) -> int:
    """Load the weights and optimizer state of ``parts``' parameters; return the step saved.
    The random state too, if saved in this ``layout``; else each rank is seeded from the
    seed, the step and its rank. Works in a process group and in a plain process."""
    path = Path(path)
    parts = list(parts)
    saved = _metadata(path)
    dicts = _state_dicts(parts)
    state = _state(parts, 0, {}, dicts=dicts)  # room for every tensor, under the saved keys
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
        _set_rng_state(mine, _device(parts))
        log.info("random state restored: the same layout saved it")
    else:
        # another layout draws other masks anyway: fresh, but reproducible and not step 0's
        seed = int(state["progress"].get("seed", 0))
        torch.manual_seed((seed * 1_000_003 + step) * 1_009 + _rank())
        why = f"saved by layout {rng['layout']!r}" if rng.get("layout") else "none saved"
        log.info(f"random state not restored ({why}): seeded from the seed, step and rank")
    return step
