"""The GPU tier: every example on CUDA (NCCL where it has a process group) against the same
run on the CPU. Run it with ``python -m pytest -m cuda``; each test skips, saying why, where
fewer GPUs are visible than it needs (the default suite deselects them and hides the GPUs).

Both runs start from the same seeded CPU-initialised weights and data; the GPU run is held to
the CPU one with ``assert_close`` at tolerances for float32 on a GPU (other reduction orders;
TF32 is switched off, ``NVIDIA_TF32_OVERRIDE=0``, so convolutions are full float32).
"""
from __future__ import annotations

import os
import re
from collections.abc import Callable

import pytest
import torch

import distkit
from ddp_rpc import main as ddp_rpc
from ddp_rpc import sharded as ddp_rpc_sharded
from pipelining_transformer import main as pipelining_transformer
from rpc_pipeline_resnet import main as rpc_pipeline_resnet
from rpc_pipeline_resnet import pipelining as rpc_pipeline_resnet_pipelining
from rpc_rnn import main as rpc_rnn
from rpc_rnn import sharded as rpc_rnn_sharded

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(600)]

GPU = {"rtol": 1e-3, "atol": 1e-4}  # several training steps of float32, other summation orders


@pytest.fixture(autouse=True)
def full_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")  # inherited by every spawned rank


def need_gpus(n: int) -> None:
    visible = distkit.gpu_count()
    if visible >= n:
        return
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        pytest.skip(f"needs {n} CUDA GPU(s); the GPUs are hidden (CUDA_VISIBLE_DEVICES=''): "
                    f"run python -m pytest -m cuda")
    pytest.skip(f"needs {n} CUDA GPU(s), {visible} visible")


def both(module, run_worker: Callable, *argv: str) -> tuple[dict, dict]:
    """The same job with --device cuda and with --device cpu: {rank: result} of each."""
    out = []
    for device in ("cuda", "cpu"):
        parser = module.build_parser()
        args = parser.parse_args([*argv, "--threads", "1", "--device", device])
        module.check_args(parser, args)
        out.append(distkit.launch(run_worker, args))
    return out[0], out[1]


@pytest.mark.parametrize("world_size", [3, 4])  # one trainer, or two with NCCL between them
def test_ddp_rpc_trainers_on_gpus(world_size):
    trainers = world_size - 2
    need_gpus(trainers)
    gpu, cpu = both(ddp_rpc, ddp_rpc.run_worker, "--world_size", str(world_size), "--epochs", "2",
                    "--batches_per_epoch", "3", "--batch_size", "8", "--seed", "1")
    gpu, cpu = gpu[trainers], cpu[trainers]
    assert [r.device for r in gpu["trainers"]] == [f"cuda:{i}" for i in range(trainers)]
    for g, c in zip(gpu["trainers"], cpu["trainers"]):
        torch.testing.assert_close(g.losses, c.losses, **GPU)
        torch.testing.assert_close(g.fc_after, c.fc_after, **GPU)
    torch.testing.assert_close(gpu["emb_after"], cpu["emb_after"], **GPU)
    assert not torch.equal(cpu["emb_after"], cpu["emb_before"])


def test_rpc_rnn_embedding_on_the_parameter_servers_gpu(capfd):
    need_gpus(1)
    gpu, cpu = both(rpc_rnn, rpc_rnn.run_worker, "--epochs", "3", "--batches", "5")
    out = capfd.readouterr().out
    assert "[rank 0] embedding table on cuda:0" in out and "[rank 0] embedding table on cpu" in out, out
    torch.testing.assert_close(gpu[1]["losses"], cpu[1]["losses"], **GPU)


@pytest.mark.parametrize("world_size", [1, 2])  # the whole table on one GPU, or its rows on two (NCCL)
def test_ddp_rpc_sharded_table_on_gpus(world_size):
    need_gpus(world_size)
    gpu, cpu = both(ddp_rpc_sharded, ddp_rpc_sharded.run_worker, "--world_size", str(world_size), "--epochs", "2",
                    "--batches_per_epoch", "3", "--batch_size", "8", "--seed", "1")
    gpu, cpu = gpu[0], cpu[0]
    assert [r.device for r in gpu["trainers"]] == [f"cuda:{i}" for i in range(world_size)]
    for g, c in zip(gpu["trainers"], cpu["trainers"]):
        torch.testing.assert_close(g.losses, c.losses, **GPU)
        torch.testing.assert_close(g.fc_after, c.fc_after, **GPU)
    torch.testing.assert_close(gpu["emb_after"], cpu["emb_after"], **GPU)


def test_rpc_rnn_sharded_embedding_and_decoder_on_gpus():
    need_gpus(2)
    gpu, cpu = both(rpc_rnn_sharded, rpc_rnn_sharded.run_worker, "--world_size", "2", "--epochs", "3",
                    "--batches", "5")
    for rank in (0, 1):
        torch.testing.assert_close(gpu[rank]["losses"], cpu[rank]["losses"], **GPU)


@pytest.mark.parametrize("gpus, devices", [(1, ["cuda:0", "cuda:0"]), (2, ["cuda:0", "cuda:1"])])
def test_rpc_pipeline_resnet_shards_on_gpus(gpus, devices, monkeypatch):
    need_gpus(gpus)
    gpu_ids = ",".join(map(str, range(gpus)))
    if os.environ.get("CUDA_VISIBLE_DEVICES"):  # keep to the GPUs the tier was given
        gpu_ids = ",".join(os.environ["CUDA_VISIBLE_DEVICES"].split(",")[:gpus])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", gpu_ids)  # the spawned shards see exactly these
    gpu, cpu = both(rpc_pipeline_resnet, rpc_pipeline_resnet.run_worker, "--batch_size", "4",
                    "--image_size", "64", "--splits", "1", "2", "--num_batches", "2",
                    "--warmup", "0", "--num_classes", "10")
    for g, c in zip(gpu[0], cpu[0]):
        assert g["devices"] == devices and c["devices"] == ["cpu", "cpu"]
        torch.testing.assert_close(g["losses"], c["losses"], **GPU)


@pytest.mark.parametrize("gpus, devices", [(1, ["cpu", "cpu"]), (2, ["cuda:0", "cuda:1"])])
def test_rpc_pipeline_resnet_pipelining_stage_per_gpu(gpus, devices, monkeypatch):
    """Two GPUs: a stage each, NCCL. One: both ranks on the CPU with gloo (NCCL wants a GPU per
    rank), as pipelining_transformer places its ranks."""
    need_gpus(gpus)
    gpu_ids = ",".join(map(str, range(gpus)))
    if os.environ.get("CUDA_VISIBLE_DEVICES"):
        gpu_ids = ",".join(os.environ["CUDA_VISIBLE_DEVICES"].split(",")[:gpus])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", gpu_ids)
    argv = ("--world_size", "2", "--batch_size", "4", "--image_size", "64", "--splits", "1", "2",
            "--num_batches", "2", "--warmup", "0", "--num_classes", "10")
    if gpus == 1:  # --device cuda would be refused: run auto, which falls back to the CPU
        parser = rpc_pipeline_resnet_pipelining.build_parser()
        args = parser.parse_args([*argv, "--threads", "1"])
        rpc_pipeline_resnet_pipelining.check_args(parser, args)
        runs = distkit.launch(rpc_pipeline_resnet_pipelining.run_worker, args)[0]
        assert all(r["devices"] == devices for r in runs)
        return
    gpu, cpu = both(rpc_pipeline_resnet_pipelining, rpc_pipeline_resnet_pipelining.run_worker, *argv)
    for g, c in zip(gpu[0], cpu[0]):
        assert g["devices"] == devices and c["devices"] == ["cpu", "cpu"]
        torch.testing.assert_close(g["losses"], c["losses"], **GPU)


@pytest.mark.parametrize("world_size, schedule", [(1, "GPipe"), (2, "1F1B"), (4, "GPipe"),
                                                  (2, "Interleaved1F1B")])  # 1, 2, 4, 4 stages
def test_pipelining_transformer_with_nccl(world_size, schedule, capfd):
    need_gpus(world_size)
    gpu, cpu = both(pipelining_transformer, pipelining_transformer.run_worker,
                    "--world_size", str(world_size), "--schedule", schedule, "--steps", "3",
                    "--dim", "32", "--n_heads", "2", "--n_layers", "4", "--vocab_size", "64",
                    "--seq_len", "8", "--batch_size", "8", "--n_microbatches", "4",
                    "--dropout", "0", "--optimizer", "sgd", "--lr", "0.1", "--seed", "3")
    out = capfd.readouterr().out
    for rank in range(world_size):
        assert re.search(rf"\[rank {rank}\] stages .* on cuda:{rank}\n", out), out
    losses = [[r["losses"] for r in run.values() if r["losses"]] for run in (gpu, cpu)]
    assert len(losses[0]) == len(losses[1]) == 1 and len(losses[1][0]) == 3
    torch.testing.assert_close(losses[0][0], losses[1][0], **GPU)
