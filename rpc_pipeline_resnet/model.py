"""The tutorial's model: ResNet50 cut after ``layer2`` into ``ResNetShard1`` and ``ResNetShard2``, each built
on its RPC worker by the master's ``DistResNet50``, which fires ``num_split`` micro-batches off at once: while
shard 2 works on micro-batch i, shard 1 works on i + 1. One ``seed``: the same weights whatever ran before."""
from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed.rpc as rpc
import torch.nn as nn
from torch.distributed.rpc import RRef
from torchvision.models.resnet import Bottleneck

NUM_CLASSES = 1000


def conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


class ResNetBase(nn.Module):
    """What both shards share: torchvision's ``_make_layer`` and the parameter RRefs. ``_lock`` serialises
    ``forward`` (the RPC agent runs each request on its own thread, and two micro-batches must not update
    BatchNorm's running statistics at once); several micro-batches can back-propagate at once."""

    def __init__(self, block: type[Bottleneck], inplanes: int, num_classes: int = NUM_CLASSES, groups: int = 1,
                 width_per_group: int = 64, norm_layer: type[nn.Module] | None = None) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._block = block
        self._norm_layer = norm_layer or nn.BatchNorm2d
        self.num_classes = num_classes
        self.inplanes = inplanes
        self.dilation = 1
        self.groups = groups
        self.base_width = width_per_group

    def _make_layer(self, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        norm_layer = self._norm_layer
        downsample = None
        previous_dilation = self.dilation
        if stride != 1 or self.inplanes != planes * self._block.expansion:
            downsample = nn.Sequential(
                conv1x1(self.inplanes, planes * self._block.expansion, stride),
                norm_layer(planes * self._block.expansion),
            )
        layers = []
        layers.append(self._block(self.inplanes, planes, stride, downsample, self.groups,
                                  self.base_width, previous_dilation, norm_layer))
        self.inplanes = planes * self._block.expansion
        for _ in range(1, blocks):
            layers.append(self._block(self.inplanes, planes, groups=self.groups,
                                      base_width=self.base_width, dilation=self.dilation,
                                      norm_layer=norm_layer))
        return nn.Sequential(*layers)

    def parameter_rrefs(self) -> list[RRef]:
        # on the shard's worker: owner RRefs, so DistributedOptimizer steps each parameter where it lives
        return [RRef(p) for p in self.parameters()]


class ResNetShard1(ResNetBase):
    """First half of ResNet50 (conv1 .. layer2), on worker1. Returns CPU activations."""

    def __init__(self, device: torch.device | str, *args: Any, seed: int = 0, **kwargs: Any) -> None:
        super().__init__(Bottleneck, 64, *args, **kwargs)
        self.device = torch.device(device)
        # initialised on the CPU from the seed, then moved (the tutorial drew on the GPU's generator); the
        # global generator left as it was. devices=[]: CUDA's generators are not drawn from
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.seq = nn.Sequential(
                nn.Conv2d(3, self.inplanes, kernel_size=7, stride=2, padding=3, bias=False),
                self._norm_layer(self.inplanes),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
                self._make_layer(64, 3),
                self._make_layer(128, 4, stride=2),
            )
            for m in self.modules():
                if isinstance(m, nn.Conv2d):
                    nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                elif isinstance(m, nn.BatchNorm2d):
                    nn.init.constant_(m.weight, 1)
                    nn.init.constant_(m.bias, 0)
        self.seq.to(self.device)

    def forward(self, x_rref: RRef) -> torch.Tensor:
        x = x_rref.to_here().to(self.device)
        with self._lock:
            out = self.seq(x)
        # RPC moves CPU tensors: the master and the other worker may have no (or other) GPUs
        return out.cpu()


class ResNetShard2(ResNetBase):
    """Second half of ResNet50 (layer3 .. avgpool, fc), on worker2. Returns CPU logits."""

    def __init__(self, device: torch.device | str, *args: Any, seed: int = 1, **kwargs: Any) -> None:
        super().__init__(Bottleneck, 512, *args, **kwargs)
        self.device = torch.device(device)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.seq = nn.Sequential(
                self._make_layer(256, 6, stride=2),
                self._make_layer(512, 3, stride=2),
                nn.AdaptiveAvgPool2d((1, 1)),
            ).to(self.device)
            self.fc = nn.Linear(512 * self._block.expansion, self.num_classes).to(self.device)

    def forward(self, x_rref: RRef) -> torch.Tensor:
        # shard 2 waits here for shard 1's output of the same micro-batch (y_rref resolves once it has run)
        x = x_rref.to_here().to(self.device)
        with self._lock:
            out = self.fc(torch.flatten(self.seq(x), 1))
        return out.cpu()


def _set_training(module_rref: RRef, mode: bool) -> None:
    """Runs on the shard's owner. Returns nothing: a shard (it holds a lock) cannot be pickled."""
    module_rref.local_value().train(mode)


class DistResNet50(nn.Module):
    """On the master: RRefs to the two shards, and micro-batches pipelined through them. ``num_split``:
    micro-batches per batch (the tutorial read an undefined ``self.split_size``); ``devices``: the shards'
    (the tutorial's "cuda:0", "cuda:1"); ``seed``: shard 1's (shard 2: ``seed + 1``)."""

    def __init__(self, num_split: int, workers: Sequence[str],
                 devices: Sequence[torch.device | str] = ("cpu", "cpu"), *args: Any,
                 seed: int = 0, **kwargs: Any) -> None:
        super().__init__()
        self.num_split = num_split
        # Put the first part of the ResNet50 on workers[0]
        self.p1_rref = rpc.remote(
            workers[0],
            ResNetShard1,
            args=(devices[0],) + args,
            kwargs={**kwargs, "seed": seed},
        )
        # Put the second part of the ResNet50 on workers[1]
        self.p2_rref = rpc.remote(
            workers[1],
            ResNetShard2,
            args=(devices[1],) + args,
            kwargs={**kwargs, "seed": seed + 1},
        )
        # rref.rpc_async() without the RRef's type yet sends the RPC from a callback outside the dist_autograd
        # context: no gradients, silently. Learn both types now, as the proxies do (private: no public way).
        for rref in (self.p1_rref, self.p2_rref):
            rref._get_type(blocking=False).wait()

    def forward(self, xs: torch.Tensor) -> torch.Tensor:
        out_futures = []
        # tensor_split: exactly num_split micro-batches whose sizes differ by at most one
        for x in xs.tensor_split(self.num_split, dim=0):
            x_rref = RRef(x)
            # both return at once: the loop queues work; y_rref makes shard 2 wait for this micro-batch's
            y_rref = self.p1_rref.remote().forward(x_rref)
            z_fut = self.p2_rref.rpc_async().forward(y_rref)
            out_futures.append(z_fut)
        return torch.cat(torch.futures.wait_all(out_futures))

    def train(self, mode: bool = True) -> DistResNet50:
        # nn.Module.train reaches local children only: tell the shards (and their BatchNorm layers) too
        super().train(mode)
        torch.futures.wait_all([rpc.rpc_async(r.owner(), _set_training, args=(r, mode))
                                for r in (self.p1_rref, self.p2_rref)])
        return self

    def parameter_rrefs(self) -> list[RRef]:
        remote_params = []
        remote_params.extend(self.p1_rref.remote().parameter_rrefs().to_here())
        remote_params.extend(self.p2_rref.remote().parameter_rrefs().to_here())
        return remote_params
