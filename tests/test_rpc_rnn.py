"""rpc_rnn: distributed forward/backward/step equal a single process's; the model learns."""
from __future__ import annotations

import argparse
import functools

import pytest
import torch
import torch.nn as nn
import torch.optim as optim

import distkit
from conftest import (FLOAT32, checked_args, on_cuda_optimizer_path, refused_before_launch, run_cli, run_torchrun,
                      state_copy)
from rpc_rnn.main import get_next_batch, make_stream
from rpc_rnn.rnn import Decoder, EmbeddingTable

SIZES = dict(ntoken=7, ninp=4, nhid=5, nlayers=2, seq_len=3, batch_size=4)
LR = 0.05  # the tutorial's learning rate


def make_args(*argv: str) -> argparse.Namespace:
    return checked_args("rpc_rnn.main", *argv)


def test_batches_are_consecutive_next_token_pairs():
    stream = make_stream(ntoken=5, pattern_len=6, batch_size=3, length=2 * 4 + 1, seed=0)
    assert stream.shape == (9, 3)
    assert torch.equal(stream, make_stream(5, 6, 3, 9, seed=0))
    assert not torch.equal(stream, make_stream(5, 6, 3, 9, seed=1))
    assert torch.equal(stream[6:], stream[:3])  # every column repeats the same 6-token pattern
    batches = list(get_next_batch(stream, seq_len=4))
    assert len(batches) == 2
    for i, (data, target) in enumerate(batches):
        assert torch.equal(data, stream[4 * i:4 * i + 4])
        assert torch.equal(target, stream[4 * i + 1:4 * i + 5])  # the next token of each


class LocalRNNModel(nn.Module):
    """The same network in one process: what RNNModel computes, without RPC."""

    def __init__(self, ntoken: int, ninp: int, nhid: int, nlayers: int) -> None:
        super().__init__()
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers)
        self.decoder = nn.Linear(nhid, ntoken)

    def forward(self, input, hidden):
        output, hidden = self.rnn(self.encoder(input), hidden)
        return self.decoder(output), hidden


def reference_training(args: argparse.Namespace, initial: dict) -> tuple[list[float], dict]:
    """run_trainer's training, written out in one process with torch.optim.SGD."""
    ref = LocalRNNModel(args.ntoken, args.ninp, args.nhid, args.nlayers)
    ref.load_state_dict(initial)
    opt = optim.SGD(ref.parameters(), lr=args.lr)
    criterion = nn.CrossEntropyLoss()
    stream = make_stream(args.ntoken, args.pattern_len, args.batch_size,
                         args.batches * args.seq_len + 1, args.seed)
    shape = (args.nlayers, args.batch_size, args.nhid)
    epoch_losses = []
    for _ in range(args.epochs):
        hidden, losses = (torch.zeros(shape), torch.zeros(shape)), []
        for data, target in get_next_batch(stream, args.seq_len):
            hidden = tuple(h.detach() for h in hidden)  # the state goes on, its graph does not
            output, hidden = ref(data, hidden)
            loss = criterion(output.reshape(-1, args.ntoken), target.reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        epoch_losses.append(sum(losses) / len(losses))
    return epoch_losses, dict(ref.named_parameters())


def weights(model) -> dict[str, torch.Tensor]:
    """CPU copies of an ``RNNModel``'s parameters, remote (through RPC) or local, named as in
    a one-process model."""
    import torch.distributed.rpc as rpc

    def remote(rref) -> dict:
        return rpc.rpc_sync(rref.owner(), state_copy, args=(rref,))

    local = {f"rnn.{k}": v.detach().clone() for k, v in model.rnn.named_parameters()}
    return remote(model.emb_table_rref) | local | remote(model.decoder_rref)


def keeping_weights(rank: int, args: argparse.Namespace) -> None:
    """rpc_rnn's ``run_worker``, with the trainer's model's weights kept before and after
    training, beside what ``run_trainer`` returns (the example keeps none): its saved result."""
    import rpc_rnn.main as example

    built, run_trainer = [], example.run_trainer

    class Kept(example.RNNModel):
        def __init__(self, *a, **kw) -> None:
            super().__init__(*a, **kw)
            built.append((self, weights(self)))

    def kept_run_trainer(a: argparse.Namespace) -> dict:
        out = run_trainer(a)
        model, initial = built[0]
        return {**out, "initial": initial, "final": weights(model)}  # before rpc.shutdown()

    example.RNNModel, example.run_trainer = Kept, kept_run_trainer
    example.run_worker(rank, args)


def sharded_weights(model) -> dict[str, torch.Tensor]:
    """CPU copies of a ``ShardedRNNModel``'s parameters, whole (a collective: every rank calls it), named
    as in a one-process model."""
    from torch.distributed.tensor import DTensor

    return {name.replace("decoder.decoder.", "decoder."): (p.full_tensor() if isinstance(p, DTensor) else p)
            .detach().cpu().clone() for name, p in model.named_parameters()}


def keeping_sharded_weights(rank: int, args: argparse.Namespace) -> None:
    """rpc_rnn/sharded.py's ``run_worker``, with the weights kept before and after training in each
    rank's saved result."""
    import rpc_rnn.sharded as example

    run_trainer = example.run_trainer

    def kept_run_trainer(model, *a) -> dict:
        initial = sharded_weights(model)
        return {**run_trainer(model, *a), "initial": initial, "final": sharded_weights(model)}

    example.run_trainer = kept_run_trainer
    example.run_worker(rank, args)


SMALL_RUN = [x for k, v in SIZES.items() for x in (f"--{k}", str(v))] + [
    "--pattern_len", "5", "--epochs", "2", "--batches", "2", "--lr", str(LR), "--seed", "4"]


@pytest.mark.fast  # also on Python 3.10 and 3.13 (.ci/run)
def test_run_trainer_matches_single_process_training():
    """The example's own run_trainer (2 epochs of 2 batches: the hidden state carried from
    batch to batch and reset every epoch) against the same training in one process."""
    args = make_args(*SMALL_RUN, "--dropout", "0")  # no dropout: no random masks to match
    out = distkit.launch(keeping_weights, args)[1]
    # the remote modules' initial weights come from the seed alone, not from the order in
    # which the parameter server's RPC threads happened to build them
    emb = EmbeddingTable(args.ntoken, args.ninp, 0.0, "cpu", seed=4)
    dec = Decoder(args.ntoken, args.nhid, 0.0, seed=5)
    for name, p in [*emb.named_parameters(), *dec.named_parameters()]:
        torch.testing.assert_close(out["initial"][name], p.detach(), rtol=0, atol=0)

    losses, final = reference_training(args, out["initial"])
    torch.testing.assert_close(out["losses"], losses, **FLOAT32)  # means of float32 losses
    assert sorted(out["final"]) == sorted(final)
    for name, p in final.items():
        torch.testing.assert_close(out["final"][name], p.detach(), msg=lambda m: f"{name}: {m}")
        assert not torch.equal(out["final"][name], out["initial"][name]), f"{name} did not move"

    # sharded.py from the same flags on 3 ranks (7 rows and columns: 3, 2, 2): the RPC version's
    # initial weights, and over the whole run its losses and one process's weights. With the optimizer
    # step the CPU takes by default, and CUDA's (foreach; the LSTM's tensors and the DTensors in
    # one list crashed there)
    sharded_args = checked_args("rpc_rnn.sharded", *SMALL_RUN, "--dropout", "0", "--world_size", "3")
    for run_worker in (keeping_sharded_weights, functools.partial(on_cuda_optimizer_path, keeping_sharded_weights)):
        ranks = distkit.launch(run_worker, sharded_args)
        assert sorted(ranks) == [0, 1, 2], ranks  # every rank saved its run
        for name, p in out["initial"].items():
            torch.testing.assert_close(ranks[0]["initial"][name], p, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
        for rank in ranks.values():
            torch.testing.assert_close(rank["losses"], out["losses"], **FLOAT32)
            for name, p in final.items():
                torch.testing.assert_close(rank["final"][name], p.detach(), **FLOAT32, msg=lambda m: f"{name}: {m}")


def test_two_runs_give_identical_losses():
    """Dropout on (its masks drawn on both processes): still the same numbers every run."""
    args = make_args(*SMALL_RUN, "--dropout", "0.3")
    first, second = (distkit.launch(keeping_weights, args)[1] for _ in range(2))
    assert first["losses"] == second["losses"]
    for name, p in first["final"].items():
        assert torch.equal(second["final"][name], p), name


# the default run learns (the README's command): tests/test_quiet_output.py


def test_torchrun_launch():
    proc = run_torchrun(2, "rpc_rnn/main.py", "--epochs", "2", "--batches", "3")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Training epoch 1\tloss" in proc.stdout


@pytest.mark.parametrize("argv, message", [
    (["--world_size", "3"], "--world_size must be at most 2"),
    (["--epochs", "0"], "argument --epochs: must be at least 1, got 0"),
    (["--ntoken", "1"], "argument --ntoken: must be at least 2, got 1"),
    (["--dropout", "1"], "argument --dropout: must be in [0, 1), got 1.0"),
    (["--seq_len", "five"], "argument --seq_len: invalid int value: 'five'"),
])
def test_bad_input_is_one_line_exit_2(argv, message, capsys, monkeypatch):
    from rpc_rnn.main import main

    assert message in refused_before_launch(main, argv, capsys, monkeypatch)


def test_bad_input_from_the_command_line_is_one_line_exit_2():
    """As a shell sees it (the other cases in-process: a Python start-up each)."""
    proc = run_cli("rpc_rnn/main.py", "--world_size", "3", timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "--world_size must be at most 2" in proc.stderr, proc.stderr
    assert "[rank" not in proc.stdout  # nothing was spawned
