"""pipelining_transformer's tutorial path holds the tutorial, and at most MAX_EXTRAS lines more.

The functions of main.py that a learner reads beside the tutorial (``TUTORIAL_PATH``) are
read statement by statement (``ast``: comments and line breaks do not count; an ``if`` or
``for`` counts as its header, its body as its own statements). Each statement is either
accounted for in ``ACCOUNTED``, by the tutorial's code line it renders (one of
``PIPELINING_TUTORIAL``), by a sentence of the tutorial's text, or by a difference the
README lists under "What differs", or it is an extra. The extras may only be the named
calls through which everything beyond the tutorial enters (the build hook, ``extras.resume``,
and ``extras.RunLog`` with its step and end calls): a new line on the path must either be
accounted for here, or be one of at most MAX_EXTRAS.
"""
from __future__ import annotations

import ast

import pytest

from conftest import DIFFERS, REPO
from tutorial_lines_pipelining import PIPELINING_TUTORIAL

pytestmark = pytest.mark.fast

MAIN = REPO / "pipelining_transformer" / "main.py"
README = REPO / "pipelining_transformer" / "README.md"
TUTORIAL_PATH = ["init_distributed", "manual_model_split", "tracer_model_split", "build_schedule",
                 "build_rank", "train", "run_worker"]
MAX_EXTRAS = 5

# Sentences of the tutorial's text (not its code) that code on the path follows
TUTORIAL_TEXT = [
    "torch.distributed.pipelining supports multiple schedules, including single-stage-per-rank "
    "schedules GPipe and 1F1B, as well as multiple-stage-per-rank schedules such as "
    "Interleaved1F1B and LoopedBFS.",
]
TUTORIAL, TEXT, DIFFERENCE = "tutorial", "text", "differs"
# statement (as ast.unparse writes it) -> (TUTORIAL, its tutorial line) | (TEXT, a sentence
# of TUTORIAL_TEXT) | (DIFFERENCE, words of the README's "What differs" section)
ACCOUNTED: dict[str, tuple[str, str]] = {
    # init_distributed
    "rank = int(os.environ['RANK'])": (TUTORIAL, 'rank = int(os.environ["LOCAL_RANK"])'),
    "world_size = int(os.environ['WORLD_SIZE'])": (TUTORIAL, 'world_size = int(os.environ["WORLD_SIZE"])'),
    "dist.init_process_group(**distkit.process_group_args('pp', rank, world_size, where))":
        (TUTORIAL, "dist.init_process_group()"),
    "return DistEnv(where.device, dp.device_mesh(where.device, world_size, dp_size))":
        (DIFFERENCE, "The tutorial's globals are one `DistEnv` value"),
    # manual_model_split
    "for i in list(model.layers):": (TUTORIAL, "for i in range(4, 8):"),
    "if int(i) not in layers:": (DIFFERENCE, "deletes the layers outside the stage's range"),
    "del model.layers[i]": (TUTORIAL, "del model.layers[str(i)]"),
    "if stage_index != 0:": (TUTORIAL, "elif stage_index == 1:"),
    "model.tok_embeddings = None": (TUTORIAL, "model.tok_embeddings = None"),
    "if stage_index != num_stages - 1:": (TUTORIAL, "if stage_index == 0:"),
    "model.norm = None": (TUTORIAL, "model.norm = None"),
    "model.output = None": (TUTORIAL, "model.output = None"),
    "model.to(device)": (TUTORIAL, "model.to(device)"),
    "stage = PipelineStage(model, stage_index, num_stages, device, group=pp_group)":
        (TUTORIAL, "stage = PipelineStage(model, stage_index, num_stages, device)"),
    "return stage": (TUTORIAL, "return stage"),
    # tracer_model_split
    "pipe = pipeline(module=model, mb_args=(example_input_microbatch,), split_spec={name: "
    "SplitPoint.BEGINNING for name in split_points})":
        (TUTORIAL, "pipe = pipeline(module=model, mb_args=(example_input_microbatch,), split_spec={...})"),
    "if len(stage_indices) == 1:": (TEXT, TUTORIAL_TEXT[0]),
    "return [pipe.build_stage(stage_indices[0], device, pp_group)]":
        (TUTORIAL, "stage = pipe.build_stage(stage_index, device, pp_group)"),
    "return [PipelineStage(pipe.get_stage_module(i).to(device), i, pipe.num_stages, device, group=pp_group) "
    "for i in stage_indices]": (DIFFERENCE, "**Several traced stages on a rank**"),
    # build_schedule
    "if name != 'GPipe':": (TEXT, TUTORIAL_TEXT[0]),
    "stage_arg = stages if is_multi_stage(name) else stages[0]": (TEXT, TUTORIAL_TEXT[0]),
    "return SCHEDULES[name](stage_arg, n_microbatches=n_microbatches, loss_fn=tokenwise_loss_fn)":
        (TEXT, TUTORIAL_TEXT[0]),
    "return ScheduleGPipe(stages[0], n_microbatches=n_microbatches, loss_fn=tokenwise_loss_fn)":
        (TUTORIAL, "schedule = ScheduleGPipe(stage, n_microbatches=num_microbatches, loss_fn=tokenwise_loss_fn)"),
    # build_rank
    "torch.manual_seed(args.seed)": (DIFFERENCE, "**One seeded model on every rank**"),
    "model_args = model_args_from(args)": (TUTORIAL, "model_args = ModelArgs()"),
    "model = Transformer(model_args)": (TUTORIAL, "model = Transformer(model_args)"),
    "layout = stage_layout(args, env, model)": (TUTORIAL, "stage_index = rank"),
    "if args.split == 'manual':": (TUTORIAL, "# stage = tracer_model_split(model, example_input_microbatch)"),
    "stages = [manual_model_split(m, i, layout.num_stages, layout.layers(i), env.device, env.pp_group) "
    "for m, i in layout.stage_models(model)]": (TUTORIAL, "stage = manual_model_split(model)"),
    "example_input_microbatch = torch.zeros(layout.rows, args.seq_len, dtype=torch.long)":
        (TUTORIAL, "example_input_microbatch = x.chunk(num_microbatches)[0]"),
    "stages = tracer_model_split(model, example_input_microbatch, layout.split_points, "
    "layout.stage_indices, env.device, env.pp_group)":
        (TUTORIAL, "# stage = tracer_model_split(model, example_input_microbatch)"),
    "schedule = build_schedule(stages, args.schedule, args.n_microbatches)":
        (TUTORIAL, "schedule = ScheduleGPipe(stage, n_microbatches=num_microbatches, loss_fn=tokenwise_loss_fn)"),
    "optimizers = [make_optimizer(args.optimizer, s.submod.parameters(), args.lr) for s in stages]":
        (DIFFERENCE, "an optimizer per stage"),
    "return PipelineRank(stages, schedule, optimizers, layout, env)": (DIFFERENCE, "an optimizer per stage"),
    # train
    "pp = build_rank(args, env)": (TUTORIAL, "stage = manual_model_split(model)"),
    "for step in range(first_step, args.steps):": (DIFFERENCE, "the tutorial's step `--steps` times"),
    # the dummy data, and --dp_size's wrapper around it
    "x, y = dp.replica_rows(synthetic_batch(step, args.batch_size, args.seq_len, args.vocab_size, "
    "args.seed), env.dp_rank, env.dp_size)": (TUTORIAL, "x = torch.ones(32, 500, dtype=torch.long)"),
    "x, y = (x.to(env.device), y.to(env.device))": (TUTORIAL, "x = x.to(device)"),
    "for opt in pp.optimizers:": (DIFFERENCE, "an optimizer per stage"),
    "opt.zero_grad(set_to_none=True)": (DIFFERENCE, "`zero_grad` before each step"),
    "losses: list[torch.Tensor] = []": (TUTORIAL, "losses = []"),
    "if pp.has_first and pp.has_last:":
        (DIFFERENCE, "plus one branch for the schedules that put the first and the last stage on one rank"),
    "pp.schedule.step(x, target=y, losses=losses, return_outputs=False)":
        (DIFFERENCE, "plus one branch for the schedules that put the first and the last stage on one rank"),
    "if pp.has_first:": (TUTORIAL, "if rank == 0:"),
    "pp.schedule.step(x)": (TUTORIAL, "schedule.step(x)"),
    "if pp.has_last:": (TUTORIAL, "elif rank == 1:"),
    "pp.schedule.step(target=y, losses=losses, return_outputs=False)": (DIFFERENCE, "`return_outputs=False`"),
    "pp.schedule.step()": (DIFFERENCE, "`else: schedule.step()` for a rank in between"),
    "opt.step()": (DIFFERENCE, "an optimizer per stage"),
    "loss = pp.batch_loss(losses, step)": (DIFFERENCE, "the batch's mean loss printed, not the list"),
    "if pp.reports:": (TUTORIAL, "elif rank == 1:"),
    "log.info(f'step {step + 1}/{args.steps}  loss {loss:.4f}')": (TUTORIAL, 'print(f"losses: {losses}")'),
    # run_worker
    "env = init_distributed(placement(worker, args), args.dp_size)": (TUTORIAL, "init_distributed()"),
    "result = train(args, env)": (DIFFERENCE, "the tutorial's step `--steps` times (`train`)"),
    "dist.destroy_process_group()": (TUTORIAL, "dist.destroy_process_group()"),
    "return result": (DIFFERENCE, "the tutorial's step `--steps` times (`train`)"),
}


def _as_unparsed(statement: str) -> str:
    """``statement`` as this Python's ``ast.unparse`` writes it (3.10 writes ``for (m, i) in``, 3.11 ``for m, i in``)."""
    if statement.endswith(":"):  # an if's or a for's header
        return _statements(ast.parse(statement + " pass").body)[0]
    return _statements(ast.parse(statement).body)[0]


def _functions(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    found = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            found[node.name] = node
        elif isinstance(node, ast.ClassDef):
            found.update({f"{node.name}.{f.name}": f for f in node.body if isinstance(f, ast.FunctionDef)})
    return found


def _statements(body: list[ast.stmt]) -> list[str]:
    """Each statement of ``body`` as ``ast.unparse`` writes it; an ``if``/``for`` as its header."""
    out = []
    for st in body:
        if isinstance(st, ast.If):
            out += [f"if {ast.unparse(st.test)}:", *_statements(st.body), *_statements(st.orelse)]
        elif isinstance(st, ast.For):
            out += [f"for {ast.unparse(st.target)} in {ast.unparse(st.iter)}:", *_statements(st.body)]
        elif isinstance(st, (ast.While, ast.With, ast.Try)):
            raise AssertionError(f"count {type(st).__name__} too: {ast.unparse(st)[:60]}")
        elif not (isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant)):  # docstrings
            out.append(ast.unparse(st).replace("\n", " "))
    return out


ACCOUNTED = {_as_unparsed(statement): account for statement, account in ACCOUNTED.items()}


def path_statements(source: str) -> dict[str, list[str]]:
    functions = _functions(ast.parse(source))
    return {name: _statements(functions[name].body) for name in TUTORIAL_PATH}


def extras_on_path(source: str) -> list[str]:
    return [f"{name}: {st}" for name, sts in path_statements(source).items()
            for st in sts if st not in ACCOUNTED]


def test_the_tutorial_path_carries_at_most_five_extra_lines():
    extras = extras_on_path(MAIN.read_text())
    assert len(extras) <= MAX_EXTRAS, (
        f"{len(extras)} statements on the tutorial path are neither the tutorial's nor a listed "
        f"difference (at most {MAX_EXTRAS}, each a named hook):\n" + "\n".join(extras))


def test_every_account_is_the_tutorial_or_a_listed_difference():
    tutorial = {line for line, _ in PIPELINING_TUTORIAL}
    readme = README.read_text()
    differs = " ".join(readme.split(DIFFERS, 1)[1].split("\n## ", 1)[0].split())
    used = {st for sts in path_statements(MAIN.read_text()).values() for st in sts}
    for statement, (kind, text) in ACCOUNTED.items():
        assert statement in used, f"accounted for, but not on the path any more: {statement}"
        if kind == TUTORIAL:
            assert text in tutorial, f"{statement}: {text!r} is not a line of the tutorial"
        elif kind == TEXT:
            assert text in TUTORIAL_TEXT
        else:
            assert " ".join(text.split()) in differs, f"{statement}: README's What differs lacks {text!r}"


def test_an_extra_line_on_the_path_is_counted():
    source = MAIN.read_text().replace("        loss = pp.batch_loss(losses, step)",
                                      "        log.info('one more')\n        loss = pp.batch_loss(losses, step)", 1)
    assert "train: log.info('one more')" in extras_on_path(source)
    assert len(extras_on_path(source)) == len(extras_on_path(MAIN.read_text())) + 1
