"""pipelining_transformer: main.py (the tutorial's program) and train.py (every schedule, any cut)
equal one process; training; launchers.

main.py's proof is one launch of 3 ranks (a first, a middle and a last stage): its workers run
main.py's own ``train`` for each schedule and split in turn, and the losses it returns are one
process's over three steps. train.py's share one launch per world size: its workers run every
(schedule, split) in turn on a tiny model, one step of train.py's loop (``train.train``, which takes
main.py's ``train_step``), and return what each rank computed, printed and logged.
"""
from __future__ import annotations

import argparse
import copy
import functools
import re

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing
from torch.multiprocessing.spawn import ProcessException

import distkit
from conftest import PRINTED_4, TINY_GPT, checked_args, on_cuda_optimizer_path, refused_before_launch, run_cli, run_torchrun
from pipelining_recorded import train_recorded
from distkit.schedules import SCHEDULES, stage_indices_for
from pipelining_transformer import main as tutorial
from pipelining_transformer.train import init_distributed, main, model_args_from
from pipelining_transformer.model import Transformer, make_optimizer, synthetic_batch, tokenwise_loss_fn
from pipelining_transformer.balance import HalfLayer, choose_split
from pipelining_transformer.layout import StageLayout, stage_bounds, stage_layout
from pipelining_transformer.model import ModelArgs

# dropout 0 so that a pipelined run and one process compute the same numbers; SGD so
# that the step is linear in the gradient (Adam's first step turns rounding noise in
# a gradient that is mathematically zero, like a key bias's, into a full lr-sized step)
TINY = ("--dim", "16", "--n_heads", "2", "--vocab_size", "32", "--seq_len", "8",
        "--batch_size", "8", "--n_microbatches", "4", "--dropout", "0",
        "--optimizer", "sgd", "--lr", "0.1", "--seed", "3")
SPLITS = ("manual", "tracer")
# world size -> (layers, the (schedule, split) runs); 4 ranks of a multi-stage schedule
# make 8 stages, so they get 8 layers
RUNS = {
    2: (4, [(s, split) for s in SCHEDULES for split in SPLITS]),
    4: (8, [("GPipe", "manual"), ("GPipe", "tracer"), ("1F1B", "manual"),
            ("Interleaved1F1B", "manual"), ("Interleaved1F1B", "tracer"),
            ("ZBVZeroBubble", "manual")]),
}


def make_args(*argv: str) -> argparse.Namespace:
    return checked_args("pipelining_transformer.train", *argv)


def tiny_args(world_size: int, *argv: str) -> argparse.Namespace:
    """The tests' model on ``world_size`` ranks, with the layers RUNS gives that size."""
    return make_args(*TINY, "--steps", "1", "--n_layers", str(RUNS[world_size][0]),
                     "--world_size", str(world_size), *argv)


def _layout(n_layers: int, pp_size: int, sizes: list[float] | None = None, schedule: str = "GPipe",
            pp_rank: int = 0) -> StageLayout:
    """The layout ``build_rank`` computes, for a rank ``pp_rank`` of ``pp_size`` (no process group:
    only --stage_layers auto measures, on the ranks)."""
    args = argparse.Namespace(schedule=schedule, n_layers=n_layers, stage_layers=sizes, batch_size=8,
                              n_microbatches=4, seq_len=8)
    place = argparse.Namespace(pp_rank=pp_rank, pp_size=pp_size, dp_size=1, device=torch.device("cpu"))
    given = copy.deepcopy(vars(args))
    layout = stage_layout(args, place, Transformer(ModelArgs(16, n_layers, 2, 32, 0.0)))
    assert vars(args) == given, "the layout is a value of its own: nothing is written back into args"
    return layout


def _layers(n_layers: int, pp_size: int, sizes: list[float] | None = None) -> list[range]:
    layout = _layout(n_layers, pp_size, sizes)
    return [layout.layers(s) for s in range(layout.num_stages)]


@pytest.mark.fast
def test_layers_are_divided_among_stages():
    assert _layers(8, 2) == [range(0, 4), range(4, 8)]
    assert _layers(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    with pytest.raises(ValueError):
        _layers(3, 4)
    assert _layers(8, 2, [5, 3]) == [range(0, 5), range(5, 8)]  # --stage_layers 5 3
    # 4.5 3.5: layer 4 on both stages, its attention on the first, its feed-forward on the second
    assert stage_bounds(8, 2, [4.5, 3.5]) == [(0, 4.5), (4.5, 8)]
    assert _layers(8, 2, [4.5, 3.5]) == [range(0, 5), range(4, 8)]
    assert _layers(8, 2, [8, 0]) == [range(0, 8), range(8, 8)]  # the head alone
    for sizes in ([4, 3], [0, 8], [4, 2, 2], [4.25, 3.75], [4.5, 4, -0.5]):
        with pytest.raises(ValueError):
            _layers(8, 2, sizes)


@pytest.mark.fast
def test_the_stage_layout_says_where_the_tracer_cuts_and_which_stages_a_rank_holds():
    even = _layout(8, 2)
    assert even.split_points == ["layers.4"] and even.chosen is None  # the tutorial's cut
    assert even.stage_layers == (4, 4) and even.rows == 2  # 8 rows in 4 micro-batches
    half = _layout(8, 2, [4.5, 3.5])
    assert half.split_points == ["layers.4.linear1"] and half.chosen == (4.5, 3.5)
    assert _layout(8, 2, [8, 0]).split_points == ["norm"]  # a last stage of the head alone
    zbv = _layout(8, 2, schedule="ZBVZeroBubble", pp_rank=1)  # V-shaped: stages 1 and 2
    assert (zbv.num_stages, zbv.stage_indices) == (4, (1, 2))
    assert zbv.split_points == ["layers.2", "layers.4", "layers.6"]
    # the manual split's models: a copy for every stage but the last, a layer owned by half halved
    model = Transformer(ModelArgs(16, 8, 2, 32, 0.0))
    first, last = _layout(8, 1, [4.5, 3.5], schedule="Interleaved1F1B").stage_models(model)
    assert [i for _, i in (first, last)] == [0, 1] and last[0] is model and first[0] is not model
    assert isinstance(first[0].layers["4"], HalfLayer) and first[0].layers["4"].part == "attention"
    assert isinstance(last[0].layers["4"], HalfLayer) and last[0].layers["4"].part == "feed_forward"


@pytest.mark.fast
def test_half_layers_compute_the_layer():
    # attention then feed-forward is the layer itself, dropout draws included (train mode)
    torch.manual_seed(0)
    layer = torch.nn.TransformerDecoderLayer(16, 2, batch_first=True)
    h = torch.randn(3, 5, 16)
    torch.manual_seed(1)
    whole = layer(h, h)
    torch.manual_seed(1)
    halves = HalfLayer(layer, "feed_forward")(HalfLayer(layer, "attention")(h, h), h)
    assert torch.equal(whole, halves)
    owned = [{n for n, _ in HalfLayer(layer, part).named_parameters()}
             for part in ("attention", "feed_forward")]
    assert not owned[0] & owned[1] and owned[0] | owned[1] == {n for n, _ in layer.named_parameters()}


@pytest.mark.fast
def test_choose_split_minimises_the_slowest_stage():
    # per micro-batch on the reference machine (32 x 128 tokens, m = 8, one thread): the
    # embedding, 8 x (attention, feed-forward), the head with the loss; whole layers give
    # 1090 / 882 ms (5 3) or 875 / 1097 (4 4); the cut inside layer 4 gives 993 / 975
    costs = [15.0] + [118.0, 92.5] * 8 + [237.5]
    split = choose_split(costs, 2)
    assert split.stage_layers == [4.5, 3.5]
    assert split.predicted_ms == pytest.approx([15 + 4 * 210.5 + 118, 92.5 + 3 * 210.5 + 237.5])
    assert split.balance == pytest.approx(sum(split.predicted_ms) / 2 / max(split.predicted_ms))
    brute = min(max(sum(costs[:1 + c]), sum(costs[1 + c:])) for c in range(1, 17))
    assert max(split.predicted_ms) == pytest.approx(brute)  # no better cut exists
    assert choose_split(costs, 1).stage_layers == [8.0]
    assert sum(choose_split(costs, 4).stage_layers) == 8
    # a head heavier than everything else: a stage of its own (the last may hold no layer)
    assert choose_split([1.0] + [1.0, 1.0] * 8 + [100.0], 2).stage_layers == [8.0, 0.0]
    assert choose_split([1.0] + [5.0, 5.0] * 8 + [0.0], 2).stage_layers == [4.0, 4.0]
    with pytest.raises(ValueError):
        choose_split([1.0, 1.0, 1.0, 1.0], 4)  # one layer: two halves and a head for 4 stages


def test_stage_placement_follows_each_schedule():
    assert stage_indices_for("GPipe", 1, 4) == [1]
    assert stage_indices_for("Interleaved1F1B", 1, 4) == [1, 5]  # looped
    assert stage_indices_for("ZBVZeroBubble", 1, 4) == [1, 6]  # V: last stage beside the first
    assert stage_indices_for("DualPipeV", 3, 4) == [3, 4]


def _equivalence_worker(rank: int, args: argparse.Namespace) -> dict:
    """One step of every (schedule, split) in args.runs, from the same initial weights."""
    env = init_distributed(rank, args)
    out = {}
    for run in args.runs:  # (schedule, split) or (schedule, split, stage_layers)
        schedule, split, *layers = run
        run_args = argparse.Namespace(**{**vars(args), "schedule": schedule, "split": split,
                                         "stage_layers": layers[0] if layers else args.stage_layers})
        out[run] = train_recorded(run_args, env)
        dist.barrier(env.pp_group)  # no run's messages can meet the next run's
    dist.destroy_process_group()
    return out


@functools.cache
def _launch(world_size: int) -> tuple[argparse.Namespace, dict | str]:
    _, runs = RUNS[world_size]
    args = tiny_args(world_size)
    for schedule, _ in runs:  # every run is one the CLI would accept
        tiny_args(world_size, "--schedule", schedule)
    args.runs = runs
    try:
        return args, distkit.launch(_equivalence_worker, args)
    except ProcessException as e:  # mp.spawn's report, with the failed rank's traceback
        return args, f"the {world_size}-rank launch failed: {e}"


@functools.cache
def _reference(world_size: int) -> dict:
    """The full model in this one process: same seed, same data, same optimizer."""
    args = tiny_args(world_size)
    torch.manual_seed(args.seed)
    model = copy.deepcopy(Transformer(model_args_from(args)))
    x, y = synthetic_batch(0, args.batch_size, args.seq_len, args.vocab_size, args.seed)
    out = model(x)  # the whole batch at once
    tokenwise_loss_fn(out, y).backward()
    # what each micro-batch's loss is within that one pass
    losses = torch.stack([tokenwise_loss_fn(o, t) for o, t in
                          zip(out.detach().chunk(args.n_microbatches), y.chunk(args.n_microbatches))])
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    make_optimizer(args.optimizer, model.parameters(), args.lr).step()
    return {"losses": losses, "grads": grads, "params": dict(model.named_parameters())}


@pytest.mark.fast  # also on Python 3.10 and 3.13 (.ci/run)
@pytest.mark.parametrize("world_size, schedule, split",
                         [(w, s, split) for w, (_, runs) in RUNS.items() for s, split in runs])
def test_pipeline_step_equals_single_process(world_size, schedule, split):
    _, results = _launch(world_size)
    assert not isinstance(results, str), results
    ref = _reference(world_size)
    per_rank = [r[(schedule, split)] for r in results.values()]
    _assert_equals_reference(per_rank, ref)


# --stage_layers on the 4-layer tiny model: the owner of each layer's attention and of its
# feed-forward block, stage by stage (a "." marks a layer of which the stage owns one half)
UNEVEN = [("GPipe", ("3", "1"), [["0", "1", "2"], ["3"]]),
          ("1F1B", ("3", "1"), [["0", "1", "2"], ["3"]]),
          ("GPipe", ("2.5", "1.5"), [["0", "1", "2."], ["2.", "3"]]),
          ("1F1B", ("1.5", "2.5"), [["0", "1."], ["1.", "2", "3"]]),
          ("GPipe", ("4", "0"), [["0", "1", "2", "3"], []]),  # the head alone
          ("GPipe", "auto", None)]


@pytest.mark.parametrize("split", SPLITS)
def test_uneven_stage_layers_step_equals_single_process(split):
    # the split the user asks for (halves and a head alone too), or the measured one: each
    # is still the model's step, every parameter on the stage the split puts it on
    args = tiny_args(2, "--split", split)
    args.runs = [(schedule, split, layers if layers == "auto" else tuple(float(n) for n in layers))
                 for schedule, layers, _ in UNEVEN]
    # with the SGD step CUDA takes by default (foreach), which the CPU does not
    results = distkit.launch(functools.partial(on_cuda_optimizer_path, _equivalence_worker), args)
    for run, (_, _, owners) in zip(args.runs, UNEVEN):
        per_rank = [results[rank][run] for rank in (0, 1)]
        _assert_equals_reference(per_rank, _reference(2))
        if owners is not None:
            assert [_layers_owned(r["params"]) for r in per_rank] == owners, run
    auto = [results[rank][args.runs[-1]]["logged"] for rank in (0, 1)]
    assert all(any(line.startswith("--stage_layers auto: ") for line in lines) for lines in auto)


def _layers_owned(params: dict) -> list[str]:
    """The layers of which a stage holds parameters, "k." where it holds one half only."""
    names = [n.split(".") for n in params if n.startswith("layers.")]
    owned = []
    for k in sorted({n[1] for n in names}, key=int):
        parts = {n[2] for n in names if n[1] == k}
        owned.append(k if {"self_attn", "linear1"} <= parts else f"{k}.")
    return owned


def _assert_equals_reference(per_rank: list[dict], ref: dict) -> None:
    """The ranks' losses, gradients and parameters after the step are the one process's,
    and so is the batch loss the run prints and writes to --loss_log."""
    losses = [r["losses"] for r in per_rank if r["losses"] is not None]
    assert len(losses) == 1, "exactly one rank holds the last stage"
    torch.testing.assert_close(losses[0], ref["losses"])
    # what the user reads: one rank prints the batch's loss, and logs it at full precision
    batch_loss = ref["losses"].mean()
    printed = [line for r in per_rank for line in r["printed"]]
    shown = re.fullmatch(r"step 1/1  loss (\d+\.\d{4})", printed[0]) if len(printed) == 1 else None
    assert shown and float(shown[1]) == pytest.approx(float(batch_loss), abs=PRINTED_4), printed
    logged = [r["loss_log"] for r in per_rank if r["loss_log"] is not None]
    assert len(logged) == 1 and [e["step"] for e in logged[0]] == [1], logged
    torch.testing.assert_close(torch.tensor(logged[0][0]["loss"]), batch_loss)
    reported = [r["reported"] for r in per_rank if r["reported"] is not None]
    assert reported == [logged[0][0]["loss"]], reported

    grads, params = {}, {}
    for r in per_rank:
        assert not set(r["grads"]) & set(grads), "a parameter lives on two stages"
        grads.update(r["grads"])
        params.update(r["params"])
    # the stages hold every parameter of the model once, under the model's own names
    assert sorted(grads) == sorted(ref["grads"])
    for name, g in ref["grads"].items():
        assert grads[name] is not None, f"{name} got no gradient"
        torch.testing.assert_close(grads[name], g, msg=lambda m: f"grad of {name}: {m}")
        torch.testing.assert_close(params[name], ref["params"][name],
                                   msg=lambda m: f"{name} after the step: {m}")


def test_cli_training_run_lowers_the_loss():
    proc = run_cli("pipelining_transformer/train.py", "--world_size", "2", "--split", "tracer",
                   "--schedule", "interleaved1f1b", "--dim", "32", "--n_heads", "2",
                   "--n_layers", "4", "--vocab_size", "64", "--seq_len", "8", "--batch_size", "16",
                   "--steps", "12", "--lr", "3e-3", timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # looped placement: rank 1 holds stages 1 and 3, the last, and prints every step
    assert "[rank 1] stages [1, 3] of 4 (Interleaved1F1B, tracer split)" in proc.stdout
    losses = [float(m) for m in re.findall(r"\[rank 1\] step \d+/12  loss (\S+)", proc.stdout)]
    assert len(losses) == 12, proc.stdout
    assert losses[-1] < 0.75 * losses[0], losses  # about 4.2 -> 2.5 (dropout 0.1 on)


def finished_run(monkeypatch, results: dict) -> None:
    """main()'s launch, as if its ranks had run and saved ``results``."""
    monkeypatch.setattr(distkit, "prepare_spawn", lambda: None)
    monkeypatch.setattr(torch.multiprocessing, "spawn", lambda *args, **kwargs: None)
    monkeypatch.setattr(distkit, "results", lambda: results)


@pytest.mark.parametrize("first_step, status", [(0, 1), (8, 0)])
def test_exit_status_judges_the_loss_of_a_run_from_step_0_only(first_step, status, monkeypatch, capsys):
    # what run_worker saved on the ranks: the reporting one's loss rose
    finished_run(monkeypatch, {0: {"losses": None, "first_step": first_step},
                               1: {"losses": [2.2372, 2.2731, 2.2869], "first_step": first_step}})
    assert main(["--world_size", "2"]) == status
    # a resumed run that is not judged says nothing; one from step 0 says why it failed
    assert capsys.readouterr().err == ("The loss did not fall: 2.2372 -> 2.2869\n" if status else "")


def test_torchrun_launch_with_v_shaped_schedule():
    proc = run_torchrun(2, "pipelining_transformer/train.py", "--schedule", "ZBVZeroBubble",
                        "--dim", "32", "--n_heads", "2", "--n_layers", "4", "--vocab_size", "64",
                        "--seq_len", "8", "--steps", "3", "--lr", "1e-2", timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # V-shaped: rank 0 holds the first stage and the last, so it prints the losses
    assert "stages [0, 3] of 4 (ZBVZeroBubble, manual split)" in proc.stdout, proc.stdout
    assert "step 3/3  loss " in proc.stdout


@pytest.mark.parametrize("argv, message", [
    (["--batch_size", "10", "--n_microbatches", "4"], "not divisible by --n_microbatches 4"),
    (["--schedule", "1F1B", "--world_size", "4", "--n_microbatches", "2"],
     "1F1B cannot run --n_microbatches 2 on 4 ranks: Number of microbatches (2) must be"),
    (["--schedule", "DualPipeV", "--n_microbatches", "2"], "DualPipeV cannot run"),
    (["--schedule", "Interleaved1F1B", "--world_size", "4", "--n_layers", "6"],
     "makes 8 stages, more than --n_layers 6"),
    (["--schedule", "PipeDream"], "unknown schedule 'PipeDream'"),
    (["--split", "auto"], "invalid choice: 'auto'"),
    (["--world_size", "0"], "--world_size must be at least 1"),
    (["--stage_layers", "5", "2"], "--stage_layers 5 2: GPipe on 2 ranks makes 2 stages; give 2 "
                                   "counts adding up to --n_layers 8 (halves allowed), each at "
                                   "least 0.5, the last at least 0"),
    (["--stage_layers", "0", "8"], "give 2 counts adding up to --n_layers 8"),
    (["--stage_layers", "4.25", "3.75"], "a layer count is a whole or half number (5, 4.5) or 'auto'"),
    (["--stage_layers", "auto", "4"], "--stage_layers auto takes no counts beside it"),
    (["--schedule", "ZBVZeroBubble", "--stage_layers", "5", "3"], "makes 4 stages; give 4 counts"),
    # argparse's float() accepts these; a nan learning rate would train nothing silently
    (["--lr", "0"], "argument --lr: must be a positive number, got 0.0"),
    (["--lr", "nan"], "argument --lr: must be a positive number, got nan"),
    (["--lr", "inf"], "argument --lr: must be a positive number, got inf"),
    (["--dropout", "nan"], "argument --dropout: must be in [0, 1), got nan"),
    # a missing directory is made; one under a file cannot be (tests/test_paths.py: all paths)
    (["--loss_log", "pyproject.toml/losses.jsonl"], "pyproject.toml is a file, not a directory"),
])
def test_bad_input_is_rejected_before_launch(argv, message, capsys, monkeypatch):
    err = refused_before_launch(main, argv, capsys, monkeypatch)
    assert message in err, err


def test_bad_input_from_the_command_line_is_one_line_exit_2():
    proc = run_cli("pipelining_transformer/main.py", "--schedule", "1F1B", "--world_size", "4",
                   "--n_microbatches", "2", timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert "1F1B cannot run --n_microbatches 2 on 4 ranks" in proc.stderr
    assert "[rank" not in proc.stdout  # nothing was spawned


# ------------------------------------------------------------------ main.py, the tutorial's program
MAIN_RUNS = [(schedule, split) for schedule in tutorial.SCHEDULES for split in SPLITS]


def _main_worker(rank: int, args: argparse.Namespace) -> dict:
    """main.py's ``run_worker``, with its ``train`` once per (schedule, split): the losses it returns."""
    pp = tutorial.init_distributed(rank, args)
    out = {}
    for schedule, split in MAIN_RUNS:
        out[schedule, split] = tutorial.train(argparse.Namespace(**{**vars(args), "schedule": schedule,
                                                                    "split": split}), pp)
        dist.barrier()  # no run's messages can meet the next run's
    dist.destroy_process_group()
    return out


def _one_process(args: argparse.Namespace) -> list[float]:
    """The whole model in one process, the whole batch at once: each step's loss."""
    torch.manual_seed(args.seed)
    model = Transformer(model_args_from(args))
    optimizer = make_optimizer(args.optimizer, model.parameters(), args.lr)
    losses = []
    for step in range(args.steps):
        x, y = synthetic_batch(step, args.batch_size, args.seq_len, args.vocab_size, args.seed)
        optimizer.zero_grad()
        loss = tokenwise_loss_fn(model(x), y)  # equal micro-batches: their mean is the batch's
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.fast  # also on Python 3.10 and 3.13 (.ci/run)
def test_main_py_trains_as_one_process():
    # 3 ranks: the first stage, one in between (schedule.step with no input), the last; 4 layers
    # cut 1 / 1 / 2; three SGD steps, so a wrong gradient anywhere shows in the next losses
    args = checked_args("pipelining_transformer.main", *TINY, "--n_layers", "4", "--world_size", "3",
                        "--steps", "3")
    results = distkit.launch(_main_worker, args)
    reference = torch.tensor(_one_process(args))
    for run in MAIN_RUNS:
        per_rank = [results[rank][run] for rank in range(3)]
        assert per_rank[0] == per_rank[1] == [], f"{run}: only the last stage has the losses"
        # float32: what one process computes in one pass, the pipeline in micro-batches on 3 ranks
        torch.testing.assert_close(torch.tensor(per_rank[2]), reference, msg=lambda m: f"{run}: {m}")
    assert reference[-1] < reference[0]


@pytest.mark.parametrize("losses, status", [([2.2372, 2.2731, 2.2869], 1), ([2.2372, 2.1], 0)])
def test_main_py_exits_1_if_the_loss_did_not_fall(losses, status, monkeypatch, capsys):
    finished_run(monkeypatch, {0: [], 1: losses})
    assert tutorial.main(["--world_size", "2"]) == status
    assert capsys.readouterr().err == ("The loss did not fall: 2.2372 -> 2.2869\n" if status else "")


@pytest.mark.parametrize("argv, message", [
    (["--batch_size", "10", "--n_microbatches", "4"], "not divisible by --n_microbatches 4"),
    (["--schedule", "1F1B", "--world_size", "4", "--n_microbatches", "2"],
     "1F1B cannot run --n_microbatches 2 on 4 ranks: Number of microbatches (2) must be"),
    (["--schedule", "Interleaved1F1B"], "argument --schedule: invalid choice: 'Interleaved1F1B'"),
    (["--world_size", "3", "--n_layers", "2"], "3 stages need at least one of --n_layers 2 layers each"),
    (["--dim", "30", "--n_heads", "8"], "--dim 30 is not divisible by --n_heads 8"),
    (["--world_size", "0"], "--world_size must be at least 1"),
    (["--lr", "nan"], "argument --lr: must be a positive number, got nan"),
    (["--dropout", "1"], "argument --dropout: must be in [0, 1), got 1.0"),
    (["--dp_size", "2"], "unrecognized arguments: --dp_size 2"),  # train.py's
])
def test_main_py_refuses_bad_input_before_launch(argv, message, capsys, monkeypatch):
    err = refused_before_launch(tutorial.main, argv, capsys, monkeypatch)
    assert message in err, err


def test_main_py_under_torchrun():
    proc = run_torchrun(2, "pipelining_transformer/main.py", *TINY_GPT, "--steps", "3", "--lr", "1e-2",
                        timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(re.findall(r"\[rank 1\] step \d/3  loss ", proc.stdout)) == 3, proc.stdout
    assert "[rank 0] step" not in proc.stdout
