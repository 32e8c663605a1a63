"""Every example's device decision for every rank, with 0, 1, 2 or 8 GPUs faked on the CPU.

Each example's ``placement(rank, args)`` is what its ranks use (and what its ``check_args`` asks for
every rank this process starts, before any starts); here ``torch.accelerator`` is made to report N CUDA
GPUs, and each rank's device and backend, or the one-line refusal, is checked. Under torchrun each
process decides and checks for its own rank, on its own machine: nothing is agreed across machines.
"""
from __future__ import annotations

import os

import pytest
import torch

import distkit
from conftest import refused_before_launch
from ddp_rpc import main as ddp_rpc
from pipelining_transformer import main as pipelining_transformer
from rpc_pipeline_resnet import main as rpc_pipeline_resnet
from rpc_pipeline_resnet import pipelining as rpc_pipeline_resnet_pipelining
from rpc_rnn import main as rpc_rnn

EXAMPLES = {"ddp_rpc": ddp_rpc, "rpc_rnn": rpc_rnn, "rpc_pipeline_resnet": rpc_pipeline_resnet,
            "rpc_pipeline_resnet.pipelining": rpc_pipeline_resnet_pipelining,
            "pipelining_transformer": pipelining_transformer}
NO_GPU = "--device cuda was asked for, but no CUDA device is visible on this machine"
SHARED_GPU = "--device cuda: NCCL needs a GPU per process"

pytestmark = pytest.mark.fast  # also on Python 3.10 and 3.13 (.ci/run)


def fake_gpus(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """``torch.accelerator`` sees ``n`` CUDA GPUs (through ``torch.cuda``), on any build of torch."""
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *_, **__: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


def decide(example: str, *argv: str) -> list[str] | str:
    """The "device backend" of every rank this process starts (backend left out where it joins no
    group): all of them under mp.spawn, its own under torchrun; or "refused", for the one line
    check_args prints (exit status 2)."""
    module = EXAMPLES[example]
    parser = module.build_parser()
    args = parser.parse_args(list(argv))
    try:
        module.check_args(parser, args)
    except SystemExit as e:
        assert e.code == 2
        return "refused"
    ranks = [int(os.environ["RANK"])] if distkit.under_torchrun() else range(args.world_size)
    return [" ".join(str(x) for x in (p.device, p.backend) if x is not None)
            for p in (module.placement(rank, args) for rank in ranks)]


def as_torchrun_rank(monkeypatch: pytest.MonkeyPatch, rank: int, world_size: int, local_rank: int,
                     local_world_size: int) -> None:
    """This process is ``rank`` as torchrun starts it: the ``local_rank``-th of ``local_world_size``
    processes on its machine."""
    for name, value in {"RANK": rank, "WORLD_SIZE": world_size, "LOCAL_RANK": local_rank,
                        "LOCAL_WORLD_SIZE": local_world_size}.items():
        monkeypatch.setenv(name, str(value))


CPU4 = ["cpu gloo", "cpu gloo", "cpu", "cpu"]  # ddp_rpc: 2 trainers, the master, the ps
NCCL4 = ["cuda:0 nccl", "cuda:1 nccl", "cpu", "cpu"]
# (example, --device, GPUs visible) -> every rank's decision; "refused" + the message below
CASES = {
    ("ddp_rpc", "auto"): {0: CPU4, 1: CPU4, 2: NCCL4, 8: NCCL4},
    ("ddp_rpc", "cpu"): {0: CPU4, 1: CPU4, 2: CPU4, 8: CPU4},
    ("ddp_rpc", "cuda"): {0: NO_GPU, 1: SHARED_GPU, 2: NCCL4, 8: NCCL4},
    ("rpc_rnn", "auto"): {0: ["cpu", "cpu"], 1: ["cuda:0", "cpu"], 2: ["cuda:0", "cpu"],
                          8: ["cuda:0", "cpu"]},
    ("rpc_rnn", "cpu"): {n: ["cpu", "cpu"] for n in (0, 1, 2, 8)},
    ("rpc_rnn", "cuda"): {0: NO_GPU, 1: ["cuda:0", "cpu"], 2: ["cuda:0", "cpu"], 8: ["cuda:0", "cpu"]},
    ("rpc_pipeline_resnet", "auto"): {0: ["cpu"] * 3, 1: ["cpu", "cuda:0", "cuda:0"],
                                      2: ["cpu", "cuda:0", "cuda:1"], 8: ["cpu", "cuda:0", "cuda:1"]},
    ("rpc_pipeline_resnet", "cpu"): {n: ["cpu"] * 3 for n in (0, 1, 2, 8)},
    ("rpc_pipeline_resnet", "cuda"): {0: NO_GPU, 1: ["cpu", "cuda:0", "cuda:0"],
                                      2: ["cpu", "cuda:0", "cuda:1"], 8: ["cpu", "cuda:0", "cuda:1"]},
    ("pipelining_transformer", "auto"): {0: ["cpu gloo"] * 2, 1: ["cpu gloo"] * 2,
                                         2: ["cuda:0 nccl", "cuda:1 nccl"],
                                         8: ["cuda:0 nccl", "cuda:1 nccl"]},
    ("pipelining_transformer", "cpu"): {n: ["cpu gloo"] * 2 for n in (0, 1, 2, 8)},
    ("pipelining_transformer", "cuda"): {0: NO_GPU, 1: SHARED_GPU, 2: ["cuda:0 nccl", "cuda:1 nccl"],
                                         8: ["cuda:0 nccl", "cuda:1 nccl"]},
    # the ResNet halves with torch.distributed.pipelining: placed as pipelining_transformer's ranks
    ("rpc_pipeline_resnet.pipelining", "auto"): {0: ["cpu gloo"] * 2, 1: ["cpu gloo"] * 2,
                                                 2: ["cuda:0 nccl", "cuda:1 nccl"],
                                                 8: ["cuda:0 nccl", "cuda:1 nccl"]},
    ("rpc_pipeline_resnet.pipelining", "cuda"): {0: NO_GPU, 1: SHARED_GPU,
                                                 2: ["cuda:0 nccl", "cuda:1 nccl"]},
}


@pytest.mark.parametrize("example, device, gpus",
                         [(e, d, n) for (e, d), by_n in CASES.items() for n in by_n])
def test_every_rank_of_every_example(example, device, gpus, monkeypatch, capsys):
    fake_gpus(monkeypatch, gpus)
    expected = CASES[(example, device)][gpus]
    got = decide(example, "--device", device)
    if isinstance(expected, str):  # a refusal: one line, the reason in it
        err = capsys.readouterr().err
        assert got == "refused" and err.count("\n") == 1 and expected in err, (got, err)
    else:
        assert got == expected


def test_pipeline_falls_back_or_refuses_rather_than_share_a_gpu(monkeypatch, capsys):
    # 4 stages, 2 GPUs: index % n would put two NCCL ranks on each GPU
    fake_gpus(monkeypatch, 2)
    assert decide("pipelining_transformer", "--world_size", "4") == ["cpu gloo"] * 4
    assert decide("pipelining_transformer", "--world_size", "4", "--device", "cuda") == "refused"
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "runs 4 processes of the group with 2 GPU(s) visible" in err, err
    fake_gpus(monkeypatch, 4)
    assert decide("pipelining_transformer", "--world_size", "4", "--device", "cuda") == [
        f"cuda:{i} nccl" for i in range(4)]


def test_machines_of_one_job_decide_for_their_own_ranks(monkeypatch, capsys):
    """Under torchrun, over several machines: each process places its own rank from what its own
    machine has (its GPUs, the ranks torchrun started there)."""
    fake_gpus(monkeypatch, 1)
    # ddp_rpc, trainer 1 with the master and the ps on a 1-GPU machine: one trainer there, so it
    # gets the GPU (trainer 0, elsewhere, decides on its own machine)
    for rank, local_rank, expected in ((1, 0, "cuda:0 nccl"), (2, 1, "cpu"), (3, 2, "cpu")):
        as_torchrun_rank(monkeypatch, rank, 4, local_rank, 3)
        assert decide("ddp_rpc") == [expected], (rank, capsys.readouterr().err)
    # both trainers on a 1-GPU machine: NCCL would put two on it, so both stay on the CPU
    for rank in (0, 1):
        as_torchrun_rank(monkeypatch, rank, 4, rank, 2)
        assert decide("ddp_rpc") == ["cpu gloo"], (rank, capsys.readouterr().err)
    # a shard alone on its machine uses that machine's GPU
    as_torchrun_rank(monkeypatch, 2, 3, 0, 1)
    assert decide("rpc_pipeline_resnet") == ["cuda:0"], capsys.readouterr().err
    fake_gpus(monkeypatch, 0)
    as_torchrun_rank(monkeypatch, 0, 3, 0, 1)
    assert decide("rpc_pipeline_resnet") == ["cpu"], capsys.readouterr().err
    # no GPU for the parameter server: refused where the ps runs, fine where the trainer does
    as_torchrun_rank(monkeypatch, 1, 2, 0, 1)
    assert decide("rpc_rnn", "--device", "cuda") == ["cpu"], capsys.readouterr().err
    as_torchrun_rank(monkeypatch, 0, 2, 0, 1)
    assert decide("rpc_rnn", "--device", "cuda") == "refused"
    assert NO_GPU in capsys.readouterr().err


def test_under_torchrun_each_process_checks_itself(monkeypatch, capsys):
    fake_gpus(monkeypatch, 2)
    # rank 3 of 4, the second process of a 2-process machine with 2 GPUs
    as_torchrun_rank(monkeypatch, 3, 4, 1, 2)
    assert decide("pipelining_transformer") == ["cuda:1 nccl"], capsys.readouterr().err
    # ... or of a 4-process machine with 2 GPUs
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert decide("pipelining_transformer", "--device", "cuda") == "refused"
    assert "runs 4 processes of the group with 2 GPU(s)" in capsys.readouterr().err


def test_pipelining_cuda_without_gpu_is_refused_before_spawn(capsys, monkeypatch):
    from pipelining_transformer.main import main

    assert NO_GPU in refused_before_launch(main, ["--device", "cuda"], capsys, monkeypatch)


def test_a_macs_gpu_leaves_auto_on_the_cpu(monkeypatch):
    """An Apple GPU (torch.accelerator's mps) is no CUDA GPU: a laptop's ranks stay on the CPU and gloo."""
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *_, **__: torch.device("mps"))
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 1)
    assert distkit.gpu_count() == 0
    assert distkit.group_placement("auto", 0, 1) == distkit.Placement(torch.device("cpu"), "gloo")
    assert distkit.pick_device("auto") == torch.device("cpu")
