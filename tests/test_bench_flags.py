"""Every benchmark refuses a bad flag as the examples do: one line, exit 2, nothing run.

One test per script in scripts/ named bench_*.py (found, not listed: a new benchmark is
tried the day it is added, and fails until ``CASES`` has its entry, if only an empty one).
Its bad command lines are of two kinds:
  - derived from the script's own parser: an unknown flag; for every flag that takes
    whole numbers, 0 and -1 (a seed may be 0); for every float, nan; for every flag with
    choices or a type of its own (a schedule, a split, a point), "bogus"; the line must
    name the flag;
  - written out below per script (``CASES``): values each fine alone that cannot work
    together, with the words the one line must hold (a split that does not divide a batch,
    a split of the layers that no schedule can run, ...).
Each is run through the same ``main(argv)`` a user runs, in this process, with
``distkit.launch`` replaced by a failure: a refusal must come before any process starts,
and before anything is measured or printed (stdout stays empty: every benchmark's first
output is its machine header). One run as a script shows the exit status a shell sees.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import time

import pytest

from conftest import REPO, run_cli

sys.path.insert(0, str(REPO / "scripts"))

BENCHMARKS = sorted(p.stem for p in (REPO / "scripts").glob("bench_*.py"))

# per script: (argv, words the error line must hold); every script is listed, even with none
CASES: dict[str, list[tuple[list[str], str]]] = {
    "bench_pipelining_transformer": [
        # before: ran 16 s, skipped every configuration and exited 0 with an empty table
        (["--stage_layers", "bogus"], "argument --stage_layers: a split is even, auto or"),
        (["--stage_layers", "5,x"], "a layer count is a whole or half number"),
        (["--stage_layers", "4.25,3.75"], "a layer count is a whole or half number"),
        (["--stage_layers", "5,auto"], "a split is even, auto or"),
        # counts that no schedule's stages take: skipped everywhere, so refused
        (["--stage_layers", "even", "5,2,1"], "--stage_layers 5 2 1 runs in none of the configurations"),
        (["--stage_layers", "6,3", "--schedules", "GPipe"], "give 2 counts adding up to --n_layers 8"),
        (["--schedules", "nope"], "unknown schedule 'nope'"),
        (["--microbatches", "3"], "is not divisible by --n_microbatches 3"),  # batch 8
        (["--steps", "3", "--warmup", "2"], "--steps at least --warmup + 2"),
        (["--model", "30", "8", "8", "100"], "--dim 30 is not divisible by --n_heads 8"),
        (["--world_size", "9", "--schedules", "GPipe", "--microbatches", "8"], "more than --n_layers 8"),
        (["--world_size", "5", "--schedules", "GPipe", "Interleaved1F1B"],
         "--schedules Interleaved1F1B runs in none of the configurations (10 stages for 8 layers)"),
        # before: nothing fit 9 ranks, and an empty table exited 0
        (["--world_size", "9"], "--world_size 9 runs none of the configurations (18 stages for 8 layers; "
                                "9 stages for 8 layers)"),
        (["--points", "8x8"], "--points needs --sweep"),
        (["--sweep", "--points", "6x8"], "is not divisible by --n_microbatches 8"),
        (["--sweep", "--points", "16"], "a point is BATCHxSEQ"),
        (["--sweep", "--points", "0x8"], "a point needs a positive batch and length"),
        (["--sweep", "--microbatches", "2", "4"], "--sweep takes one --microbatches value"),
        (["--sweep", "--stage_layers", "5,2,1"], "give 2 counts adding up to --n_layers 8"),
    ],
    "bench_rpc_pipeline_resnet": [
        (["--splits", "32"], "--splits values must be in 1..16"),
        (["--batch_size", "6", "--splits", "4", "--sweep_splits", "2"],
         "--splits values must divide --batch_size 6"),
        (["--sweep_splits", "3"], "--splits values must divide --batch_size 16"),
        (["--engine", "pipelining", "--schedules", "1F1B", "--splits", "1", "--sweep_splits", "1"],
         "--schedules 1F1B can run none of the configurations"),
    ],
    "bench_ddp_rpc": [(["--tables", "large"], "--tables needs --versus")],
    "bench_return_outputs": [(["--steps", "2", "--warmup", "2"], "--steps must be more than --warmup")],
    "bench_rpc_rl": [
        (["--threshold", "600"], "--threshold must be in (0, 500]"),
        (["--world_sizes", "1"], "must be at least 2"),
        (["--solve_sizes", "1"], "must be at least 2"),
    ],
    "bench_rpc_rnn": [
        (["--ranks", "4"], "--ranks needs --versus"),  # before: ignored, and the run went on
        (["--versus", "--ranks", "20"], "--world_size 20 is more ranks than --ntoken"),
    ],
}
UNKNOWN = (["--no_such_flag"], "unrecognized arguments: --no_such_flag")


def derived_cases(parser: argparse.ArgumentParser) -> list[tuple[list[str], str]]:
    """Bad values for each flag of ``parser``, from its own description of the flag."""
    cases = [UNKNOWN]
    for action in parser._actions:
        if not action.option_strings or action.nargs == 0:  # --help, --quick, --sweep
            continue
        flag = action.option_strings[0]
        n = action.nargs if isinstance(action.nargs, int) else 1

        def case(value: str) -> tuple[list[str], str]:
            return [flag, *[value] * n], flag

        kind = getattr(action.type, "__name__", None)  # distkit.args' types: "int", "float", "path"
        if action.choices is not None or kind not in (None, "int", "float", "str", "path"):
            cases.append(case("bogus"))
        elif kind == "int":
            cases.append(case("-1"))
            if flag != "--seed":
                cases.append(case("0"))
        elif kind == "float":
            cases.append(case("nan"))
    return cases


class Launched(Exception):
    """Raised in place of ``distkit.launch``: the benchmark went on to run a job."""


def refusal_problem(main, argv: list[str], words: str, capsys, monkeypatch) -> str | None:
    """What is wrong with how ``main(argv)`` refuses ``argv``, or None: it must exit 2 with
    one line on stderr that holds ``words``, having launched and printed nothing."""
    import distkit

    def launch(*args, **kwargs):
        raise Launched()

    monkeypatch.setattr(distkit, "launch", launch)
    try:
        main(argv)
        code = "returned"
    except Launched:
        code = "launched a job"
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    if code != 2:
        return f"{argv}: {code} (exit 2 expected); stdout {out[-300:]!r}, stderr {err[-300:]!r}"
    if err.count("\n") != 1 or not err.endswith("\n"):
        return f"{argv}: not one line: {err!r}"
    if out:  # nothing measured: every benchmark prints its machine header first
        return f"{argv}: printed {out[:300]!r} before refusing"
    if words not in err or ": error: " not in err:
        return f"{argv}: {err.strip()!r} should hold {words!r}"
    return None


@pytest.mark.fast
@pytest.mark.parametrize("name", BENCHMARKS)
def test_every_bad_flag_is_refused_before_anything_runs(name, capsys, monkeypatch):
    assert name in CASES, f"scripts/{name}.py: list its bad flag combinations in CASES (or none)"
    module = importlib.import_module(name)
    cases = derived_cases(module.build_parser()) + CASES[name]
    assert len(cases) > 3, cases  # the parser was read
    wrong = [problem for argv, words in cases
             if (problem := refusal_problem(module.main, argv, words, capsys, monkeypatch))]
    assert not wrong, f"{len(wrong)} of {len(cases)} bad command lines of {name}:\n" + "\n".join(wrong)


@pytest.mark.fast
def test_the_default_schedules_skip_what_a_width_cannot_run(capsys, monkeypatch):
    """Unnamed defaults are skipped where they cannot run, not refused: on 5 ranks the
    multi-stage schedules make 10 stages for 8 layers, and GPipe and 1F1B still run (named,
    such a schedule is refused, as the case in ``CASES`` shows)."""
    import distkit
    module = importlib.import_module("bench_pipelining_transformer")

    def launch(*args, **kwargs):
        raise Launched()

    monkeypatch.setattr(distkit, "launch", launch)
    with pytest.raises(Launched):
        module.main(["--world_size", "5", "--microbatches", "8"])
    out = capsys.readouterr().out
    for schedule in ("Interleaved1F1B", "ZBVZeroBubble"):
        assert f"# skipped {schedule} m=8 (even): 10 stages for 8 layers" in out, out


@pytest.mark.fast
def test_a_bogus_split_as_a_script_is_one_line_at_once():
    """As a shell sees it: exit 2 and one line at once, not an empty table 16 s later."""
    start = time.monotonic()
    proc = run_cli("scripts/bench_pipelining_transformer.py", "--stage_layers", "bogus", timeout=60)
    assert (proc.returncode, proc.stdout) == (2, ""), proc.stdout + proc.stderr
    assert proc.stderr.startswith("bench_pipelining_transformer.py: error: argument --stage_layers")
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert time.monotonic() - start < 30  # interpreter and torch's import; no job ran
