"""How much float32 rounding moves rpc_pipeline_resnet's second loss: the GPU tier's ResNet case, on the CPU.

The GPU tier's case (tests/test_cuda.py, ``RESNET``: 16 images of 96 px, 10 classes, SGD at lr 0.001, seed 0,
2 batches, 1 and 2 micro-batches) compares a GPU's losses with the CPU's, both float32, TF32 off; its loss after
a step has been found further off than its first. Here the same training runs in one process (the shards one
after the other, as the example's RPC pipeline computes them) in float32 on 1 and on 2 threads, and in float64,
the reference; then in float32 with every gradient of the first step perturbed by a relative error ``eps``
(seeded noise), as another convolution algorithm's rounding would be. It prints, per micro-batch count: each
run's losses and their distance from float64's, the first backward's worst layers (float32 against float64),
and the second loss's sensitivity to ``eps``; ``main`` returns the same as rows (docs/results.md's table).

    .venv/bin/python scripts/resnet_precision.py            # about two minutes on 2 cores
    .venv/bin/python scripts/resnet_precision.py --quick    # 8 images of 64 px
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rpc_pipeline_resnet.model import ResNetShard1, ResNetShard2  # noqa: E402

NUM_CLASSES, LR, SEED = 10, 0.001, 0


class Here:
    """An RRef's stand-in for the shards' ``forward(x_rref)``: the tensor, where it is."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value

    def to_here(self) -> torch.Tensor:
        return self.value


def train(splits: int, batch: int, image: int, dtype: torch.dtype, threads: int, eps: float = 0.0,
          batches: int = 2, device: str = "cpu") -> tuple[list[float], dict[str, torch.Tensor]]:
    """The example's training in this process: its losses, and the first backward's gradients (by name)."""
    torch.set_num_threads(threads)
    shards = [ResNetShard1(device, num_classes=NUM_CLASSES, seed=SEED).to(dtype),
              ResNetShard2(device, num_classes=NUM_CLASSES, seed=SEED + 1).to(dtype)]
    params = {f"shard{i + 1}.{n}": p for i, s in enumerate(shards) for n, p in s.named_parameters()}
    opt = torch.optim.SGD(params.values(), lr=LR)
    gen = torch.Generator().manual_seed(SEED)  # the example's data: labels first, then each batch's images
    labels = torch.zeros(batch, NUM_CLASSES).scatter_(1, torch.randint(0, NUM_CLASSES, (batch, 1), generator=gen), 1)
    noise = torch.Generator().manual_seed(1)
    losses, first = [], {}
    for step in range(batches):
        inputs = torch.randn(batch, 3, image, image, generator=gen).to(dtype)
        out = torch.cat([shards[1](Here(shards[0](Here(x)))) for x in inputs.tensor_split(splits)])
        loss = nn.MSELoss()(out, labels.to(dtype))
        opt.zero_grad()
        loss.backward()
        if step == 0:
            for p in params.values():
                if eps:
                    p.grad *= 1 + eps * torch.randn(p.grad.shape, generator=noise, dtype=dtype).to(p.device)
            first = {n: p.grad.detach().double().cpu() for n, p in params.items()}
        opt.step()
        losses.append(loss.item())
    return losses, first


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def main(argv: list[str] | None = None) -> list[dict]:
    """A row a run: ``splits``, ``run``, its ``first`` and ``second`` loss, their distance from float64's in
    percent (``first_pct``, ``second_pct``), the first backward's worst layer (``worst_layer``, its relative
    error ``worst_grad``); for a perturbed run, ``moved_pct``: how far the noise moved the second loss from
    the unperturbed float32 run's (1 thread)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 images of 64 px")
    parser.add_argument("--device", default="cpu", help="where the shards compute (cuda: the GPU's float32 and "
                                                         "float64 beside the CPU's float64)")
    args = parser.parse_args(argv)
    batch, image = (8, 64) if args.quick else (16, 96)
    threads = torch.get_num_threads()  # train() sets its own: the caller's back at the end (pages.py runs main here)
    try:
        return _compare(args, batch, image)
    finally:
        torch.set_num_threads(threads)


def _compare(args: argparse.Namespace, batch: int, image: int) -> list[dict]:
    rows = []
    print(f"# rpc_pipeline_resnet, one process: {batch} images of {image} px, {NUM_CLASSES} classes, SGD lr {LR}, "
          f"seed {SEED}; torch {torch.__version__}; {args.device}")
    for splits in (1, 2):
        ref, ref_grads = train(splits, batch, image, torch.float64, 1)
        print(f"\nsplits {splits}: float64 losses {ref[0]:.8f} {ref[1]:.8f} (cpu)")
        rows.append({"splits": splits, "run": "float64, 1 thread", "first": ref[0], "second": ref[1]})
        plain = None  # float32 on 1 thread, unperturbed: what the noise moves
        runs = [(f"float32, {t} thread(s)", torch.float32, t, "cpu") for t in (1, 2)]
        if args.device != "cpu":
            runs += [(f"float32 on {args.device}", torch.float32, 1, args.device),
                     (f"float64 on {args.device}", torch.float64, 1, args.device)]
        for what, dtype, threads, device in runs:
            losses, grads = train(splits, batch, image, dtype, threads, device=device)
            plain = plain or losses
            worst = sorted(((relative(grads[n], g), n) for n, g in ref_grads.items()), reverse=True)[:3]
            first, second = (100 * abs(losses[i] - ref[i]) / ref[i] for i in (0, 1))
            print(f"  {what}: losses {losses[0]:.8f} {losses[1]:.8f}, {first:.5f} % and {second:.5f} % "
                  f"from float64; first gradients' worst layers: " + ", ".join(f"{n} {e:.1e}" for e, n in worst))
            rows.append({"splits": splits, "run": what, "first": losses[0], "second": losses[1], "first_pct": first,
                         "second_pct": second, "worst_grad": worst[0][0], "worst_layer": worst[0][1]})
        for eps in (1e-6, 1e-5, 1e-4, 1e-3):
            losses, _ = train(splits, batch, image, torch.float32, 1, eps=eps)
            second, moved = 100 * abs(losses[1] - ref[1]) / ref[1], 100 * abs(losses[1] - plain[1]) / plain[1]
            print(f"  float32, first gradients x (1 + {eps:g} noise): second loss {second:.4f} % from float64, "
                  f"{moved:.4f} % from float32's")
            rows.append({"splits": splits, "run": f"float32, first gradients x (1 + {eps:g} noise)",
                         "first": losses[0], "second": losses[1], "second_pct": second, "moved_pct": moved})
    return rows


if __name__ == "__main__":
    main()
