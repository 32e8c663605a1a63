"""Every example's device decision for every rank, with 0, 1, 2 or 8 GPUs faked on the CPU.

Each example's ``placement(worker, args)`` is what its workers use (and what its
``check_args`` asks for every local process before any starts); here ``torch.accelerator`` is made
to report N CUDA GPUs, and each rank's device and backend, or the one-line refusal, is checked.
"""
from __future__ import annotations

import argparse

import pytest
import torch

import distkit
from conftest import refused_before_launch
from ddp_rpc import main as ddp_rpc
from pipelining_transformer import main as pipelining_transformer
from pipelining_transformer.main import init_distributed
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
    """Every local rank's "device backend" (backend left out where it joins no group), or
    the one-line refusal check_args prints (exit status 2)."""
    module = EXAMPLES[example]
    parser = module.build_parser()
    args = parser.parse_args(list(argv))
    try:
        module.check_args(parser, args)
    except SystemExit as e:
        assert e.code == 2
        return "refused"
    return [" ".join(str(x) for x in (p.device, p.backend) if x is not None)
            for p in (module.placement(w, args) for w in distkit.local_workers(args))]


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


def test_machines_of_one_job_decide_for_their_own_ranks(monkeypatch):
    far = ("--master_addr", "192.0.2.1", "--master_port", "29400")  # rank 0's machine (TEST-NET-1)
    fake_gpus(monkeypatch, 1)
    # ddp_rpc, trainer 1 with the master and the ps on a 1-GPU machine: one trainer here,
    # so it gets the GPU (trainer 0, elsewhere, decides on its own machine)
    assert decide("ddp_rpc", "--ranks", "1-3", *far) == ["cuda:0 nccl", "cpu", "cpu"]
    assert decide("ddp_rpc", "--ranks", "0-1", *far) == ["cpu gloo", "cpu gloo"]
    # a shard alone on its machine uses that machine's GPU
    assert decide("rpc_pipeline_resnet", "--ranks", "2", *far) == ["cuda:0"]
    fake_gpus(monkeypatch, 0)
    assert decide("rpc_pipeline_resnet", "--ranks", "0", *far) == ["cpu"]
    # no GPU for the parameter server: refused where the ps runs, fine elsewhere
    assert decide("rpc_rnn", "--ranks", "1", "--device", "cuda", *far) == ["cpu"]
    assert decide("rpc_rnn", "--ranks", "0", "--device", "cuda", *far) == "refused"


def test_under_torchrun_each_process_checks_itself(monkeypatch, capsys):
    fake_gpus(monkeypatch, 2)
    # rank 3 of 4, the second process of a 2-process machine with 2 GPUs
    for name, value in {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    assert decide("pipelining_transformer") == ["cuda:1 nccl"], capsys.readouterr().err
    # ... or of a 4-process machine with 2 GPUs
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert decide("pipelining_transformer", "--device", "cuda") == "refused"
    assert "runs 4 processes of the group with 2 GPU(s)" in capsys.readouterr().err


def test_backend_disagreement_names_each_machine():
    assert distkit.device.backend_disagreement([("a", "2", "cuda:0", "nccl")] * 2) is None
    message = distkit.device.backend_disagreement([
        ("gpu-host", "2", "cuda:0", "nccl"), ("gpu-host", "2", "cuda:1", "nccl"),
        ("cpu-host", "0", "cpu", "gloo")])
    assert "\n" not in message
    assert "gpu-host sees 2 GPU(s) -> nccl (ranks 0,1); cpu-host sees 0 GPU(s) -> gloo (rank 2)" in message


def _stage_seeing_its_own_gpus(worker: distkit.Worker, args: argparse.Namespace) -> None:
    """A pipeline rank on a "machine" of its own: rank 0's sees 2 GPUs, rank 1's none."""
    fake_gpus(pytest.MonkeyPatch(), 2 if worker.rank == 0 else 0)
    # the placement every rank computes, as run_worker does: stop before NCCL is tried
    init_distributed(worker, pipelining_transformer.placement(worker, args))
    raise AssertionError("init_distributed went on with different backends")


def _trainer_seeing_its_own_gpus(worker: distkit.Worker, args: argparse.Namespace) -> None:
    fake_gpus(pytest.MonkeyPatch(), 2 if worker.rank == 0 else 0)
    ddp_rpc.run_worker(worker, args)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("example, fn", [
    ("pipelining_transformer", _stage_seeing_its_own_gpus),
    ("ddp_rpc", _trainer_seeing_its_own_gpus),
])
def test_machines_that_disagree_stop_with_one_line(example, fn, capfd):
    module = EXAMPLES[example]
    parser = module.build_parser()
    args = parser.parse_args(["--threads", "1"])
    module.check_args(parser, args)  # this machine (no GPU) is fine on its own
    with pytest.raises(SystemExit) as exit_info:
        distkit.launch(fn, args)
    err = capfd.readouterr().err
    assert exit_info.value.code == 2
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "chose different backends" in lines[0], err
    assert "sees 2 GPU(s) -> nccl (rank 0)" in lines[0] and "sees 0 GPU(s) -> gloo (rank 1)" in lines[0]


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
