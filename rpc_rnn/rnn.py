"""The tutorial's model: ``EmbeddingTable`` and ``Decoder`` on the parameter server, ``RNNModel`` (its
``LSTM`` local, ``RRef``s to the other two) on the trainer. A forward pass is two synchronous RPCs
(embedding lookup, decoding) around the LSTM; every tensor crossing RPC is a CPU tensor."""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.rpc as rpc
import torch.nn as nn
from torch.distributed.rpc import RRef

log = logging.getLogger(__name__)

PS_NAME = "ps"
TRAINER_NAME = "trainer"


def _call_method(method: Callable[..., Any], rref: RRef, *args: Any, **kwargs: Any) -> Any:
    """Runs on the owner of ``rref``: apply ``method`` to the object the RRef points to."""
    return method(rref.local_value(), *args, **kwargs)


def _remote_method(method: Callable[..., Any], rref: RRef, *args: Any, **kwargs: Any) -> Any:
    """Run ``method(<object behind rref>, *args)`` on the RRef's owner and wait for the result (inside a
    ``dist_autograd.context()`` the RPC is recorded: the backward pass follows it back to the owner)."""
    return rpc.rpc_sync(rref.owner(), _call_method, args=(method, rref, *args), kwargs=kwargs)


def _parameter_rrefs(module: nn.Module) -> list[RRef]:
    """One local ``RRef`` per parameter, for ``DistributedOptimizer`` (runs on the owner)."""
    return [RRef(param) for param in module.parameters()]


def _uniform_(weight: torch.Tensor, seed: int | None) -> None:
    """U(-0.1, 0.1), the tutorial's init, from ``seed``'s own generator when one is given: the ps builds
    both remote modules on whichever RPC threads come first, so its global generator would make their
    weights depend on that thread order."""
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    with torch.no_grad():
        weight.uniform_(-0.1, 0.1, generator=gen)


class EmbeddingTable(nn.Module):
    """Encoding layer of the RNNModel, made on the parameter server by ``rpc.remote``, on ``device``
    (main.py's ``ps_device``: the server's GPU if it has one)."""

    def __init__(self, ntoken: int, ninp: int, dropout: float, device: torch.device | str = "cpu",
                 seed: int | None = None) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        # initialised before the move, so a seed gives the same weights on CPU and GPU
        _uniform_(self.encoder.weight, seed)
        self.encoder.to(self.device)
        log.info(f"embedding table on {self.device}")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # RPC hands us CPU tensors and must be given CPU tensors back
        return self.drop(self.encoder(input.to(self.device)).cpu())


class Decoder(nn.Module):
    """Output layer of the RNNModel (LSTM state -> token scores); lives on the parameter server."""

    def __init__(self, ntoken: int, nhid: int, dropout: float, seed: int | None = None) -> None:
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        self.decoder.bias.data.zero_()
        _uniform_(self.decoder.weight, seed)

    def forward(self, output: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.drop(output))


class RNNModel(nn.Module):
    """On the trainer: the LSTM and an ``RRef`` to each remote sub-module on ``ps`` (``self.parameters()``
    holds only the LSTM's; ``parameter_rrefs()`` reaches all)."""

    def __init__(self, ps: str, ntoken: int, ninp: int, nhid: int, nlayers: int,
                 dropout: float = 0.5, device: torch.device | str = "cpu", seed: int = 0) -> None:
        super().__init__()
        # setup embedding table remotely (each remote module gets its own seed: see _uniform_)
        self.emb_table_rref = rpc.remote(ps, EmbeddingTable, args=(ntoken, ninp, dropout, device, seed))
        # setup LSTM locally (its dropout acts between layers only, so none with one layer)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout if nlayers > 1 else 0.0)
        # setup decoder remotely
        self.decoder_rref = rpc.remote(ps, Decoder, args=(ntoken, nhid, dropout, seed + 1))

    def forward(self, input: torch.Tensor, hidden: tuple[torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        # pass input to the remote embedding table and fetch emb tensor back
        emb = _remote_method(EmbeddingTable.forward, self.emb_table_rref, input)
        output, hidden = self.rnn(emb, hidden)
        # pass output to the remote decoder and get the decoded output back
        decoded = _remote_method(Decoder.forward, self.decoder_rref, output)
        return decoded, hidden

    def parameter_rrefs(self) -> list[RRef]:
        """RRefs to every parameter: the embedding's and decoder's (owned by ps), the LSTM's (ours)."""
        remote_params = []
        # get RRefs of embedding table
        remote_params.extend(_remote_method(_parameter_rrefs, self.emb_table_rref))
        # create RRefs for local parameters
        remote_params.extend(_parameter_rrefs(self.rnn))
        # get RRefs of decoder
        remote_params.extend(_remote_method(_parameter_rrefs, self.decoder_rref))
        return remote_params
