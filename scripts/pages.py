"""The pages' generator: every output block, table of measured figures and picture on the pages is
written here, from a run, by cog (cogapp), and names the sitting it came from.

    .venv/bin/python scripts/pages.py                    # every page: a full sitting
    .venv/bin/python scripts/pages.py rpc_rnn            # one example's parts, on every page
    .venv/bin/python scripts/pages.py docs/results.md    # one page
    PAGES_ONLY=--sweep .venv/bin/python scripts/pages.py docs/pipelining_transformer_benchmark.md
                                                         # that page's tables whose flags hold "--sweep"

A page holds cog blocks, hidden from its reader in HTML comments; cog runs each and writes what it
printed below it, up to the block's end marker, with a checksum that catches a hand edit::

    <!-- [[[cog pages.output("rpc_rnn", ".venv/bin/python rpc_rnn/main.py") ]]] -->
    ...the command's output, then a hidden line: the part's fingerprint and sitting...
    <!-- [[[end]]] (sum: ...) -->

Its last block, ``pages.sitting_line()``, names the page's sitting(s). The fingerprint is a hash of what the
part ran (its example's code, distkit/, the measuring script, without comments and docstrings) and of
torch's version: tests/test_generated.py recomputes it, and fails, naming the refresh command, once the
code has changed since. The same test re-runs every output block's command and compares, by ``same``,
what it prints now with the block. Cog's own namespace cannot hold the generating code: mp.spawn's
ranks could not unpickle functions defined there.
"""
from __future__ import annotations

import argparse
import ast
import base64
import datetime
import functools
import hashlib
import io
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tokenize
import traceback
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = ("rpc_rl", "rpc_rnn", "ddp_rpc", "rpc_pipeline_resnet", "pipelining_transformer")
ONLY = "PAGES_ONLY"  # the one example whose parts this run regenerates (the others are kept as they are)
PART = re.compile(r"<!-- part: (\{.*\}) -->")
GPU_RESULTS = REPO / "docs" / "results" / "gpu.json"  # scripts/gpu_check.py writes it on the GPU machine
NOT_RERUN = "Not re-run since"
# A printed decimal matches within this many units of its last digit: what another thread count's
# rounding moves (rpc_rnn's last loss, 0.0554 or 0.0555), or ddp_rpc's racing trainers (2.5681 or
# 2.5682); a change in any other digit is ten units or more.
UNITS = 2


def pages() -> list[Path]:
    """Every page that holds a generated part."""
    found = [REPO / "README.md", *sorted(REPO.glob("*/README.md")), *sorted((REPO / "docs").glob("*.md"))]
    return [p for p in found if "[[[cog" in p.read_text()]


# ---- what a part ran: its fingerprint ----

def _without_docs(source: str) -> str:
    """``source`` as the interpreter runs it: no comments, no docstrings, no blank lines (line-based, so the
    same on every Python a test runs on; ``ast.unparse``'s layout changes between versions)."""
    lines = source.splitlines()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            for i in range(body[0].lineno - 1, body[0].end_lineno):
                lines[i] = ""
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            lines[row - 1] = lines[row - 1][:col]
    return "\n".join(line.rstrip() for line in lines if line.strip())


def fingerprint(sources: Sequence[str], torch_version: str, root: Path = REPO) -> str:
    """A hash of the Python files under ``sources`` (folders or files, from ``root``) and of torch's version:
    what a part's figures depend on."""
    h = hashlib.sha256(torch_version.encode())
    for name in sources:
        top = root / name
        for f in sorted(top.rglob("*.py")) if top.is_dir() else [top]:
            h.update(str(f.relative_to(root)).encode())
            h.update(_without_docs(f.read_text()).encode() if f.suffix == ".py" else f.read_bytes())
    return h.hexdigest()[:16]


def sources_of(example: str, *extra: str) -> list[str]:
    return [example, "distkit", *extra]


# ---- the sitting ----

@functools.cache
def _machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.machine()) if Path("/proc/cpuinfo").exists() \
        else platform.machine()
    return f"{cpu}, {os.cpu_count()} cores"


@functools.cache
def _commit() -> str:
    """This checkout's commit, marked as modified where its code (not a page, not a picture) was."""
    git = ["git", "-C", str(REPO)]
    sha = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no", "--", ".",
                            ":!*.md", ":!docs/"], capture_output=True, text=True).stdout.strip()
    return f"{sha or 'no commit'}{' (modified)' if dirty else ''}"


def sitting(threads: str | None) -> str:
    import torch

    return (f"{datetime.date.today().isoformat()}, commit {_commit()}, {_machine()}, {threads or 'default threads'}, "
            f"torch {torch.__version__}, Python {platform.python_version()}")


# ---- the parts, called from cog's blocks ----

_seen: dict[str, list[tuple[str, str]]] = {}  # page -> (heading, sitting) of each part so far


def _cog():
    import cog  # cogapp's module, there while cog runs a block

    return cog


def _heading() -> str:
    cog = _cog()
    lines = Path(cog.inFile).read_text().splitlines()[:cog.firstLineNum]
    return next((line.lstrip("#").strip() for line in reversed(lines) if line.startswith("#")), "")


def _kept(example: str, detail: str = "") -> bool:
    """Keep this part as it is: this run regenerates another example's parts only, or the tables whose
    script and flags hold the text it was given (``PAGES_ONLY=--sweep``)."""
    only = os.environ.get(ONLY)
    return bool(only) and only != example and only not in detail


_failed: list[str] = []  # the parts whose run raised: kept as they were, and the generator exits 1


def _importable() -> None:
    """The repo's root, scripts/ and tests/ on ``sys.path`` (the benchmarks and make_pictures import from
    them, and cog restores ``sys.path`` after each page)."""
    for folder in (REPO / "tests", REPO / "scripts", REPO):
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))


def _part(example: str, sources: Sequence[str], write, threads: str | None = None, detail: str = "") -> None:
    """Write a part through ``write(out)`` and its hidden line; or keep it as it was: where this run
    regenerates another example's parts, or where its run raised (reported, and the exit status is 1)."""
    import torch

    cog = _cog()
    lines: list[str] = []
    if not _kept(example, detail):
        _importable()
        try:
            write(lines.append)
        except (Exception, SystemExit):  # a failed run, or a script's exit (a parity picture that disagrees)
            traceback.print_exc()
            _failed.append(f"{cog.inFile}:{cog.firstLineNum}")
            lines = []
    if lines:
        meta = {"example": example, "sources": list(sources), "torch": torch.__version__,
                "fingerprint": fingerprint(sources, torch.__version__), "sitting": sitting(threads)}
        for line in lines:
            cog.outl(line)
        cog.outl(f"<!-- part: {json.dumps(meta)} -->")
    else:
        cog.out(cog.previous)
        found = PART.search(cog.previous)
        meta = json.loads(found.group(1)) if found else {"sitting": "not generated"}
    _seen.setdefault(cog.inFile, []).append((_heading(), meta["sitting"]))


def output(example: str, command: str, head: int | None = 1, tail: int | None = 1, units: int = UNITS,
           timeout: float = 300) -> None:
    """An output block: ``command`` run from the repo's root, what it printed (stdout) as ``shown`` keeps it.
    ``head``/``tail``/``units``: see ``shown`` and ``same``; tests/test_generated.py re-runs it with them."""
    def write(out) -> None:
        text = run(command, timeout)
        out("```text")
        out(f"$ {command}")
        for line in shown(text.splitlines(), head, tail):
            out(line)
        out("```")

    _part(example, sources_of(example), write, _threads(example, command))


# each example's processes where its command does not say (main.py's default --world_size)
PROCESSES = {"rpc_rl": 2, "rpc_rnn": 2, "ddp_rpc": 4, "rpc_pipeline_resnet": 3, "pipelining_transformer": 2}


def _threads(example: str, command: str) -> str:
    """The intra-op threads each process of ``command`` takes by default: distkit's share of the cores."""
    import distkit

    found = re.search(r"--(?:world_size|nproc_per_node)[ =](\d+)", command)
    n = distkit.threads_per_process(int(found.group(1)) if found else PROCESSES[example])
    return f"{n} thread{'s' if n > 1 else ''} a process"


def table(example: str, script: str, argv: Sequence[str], columns: dict[str, str], plot: str | None = None,
          extra: Sequence[str] = (), threads: str = "1 thread a process") -> None:
    """A table of measured figures: the rows ``scripts/<script>.py``'s ``main(argv)`` returns, with the
    ``columns`` (a row's key -> the heading shown), floats to 3 significant digits; ``plot``: where the
    same run draws its picture (docs/results/..., which only this generator writes)."""
    def write(out) -> None:
        rows = _rows(script, [*argv, *(["--plot", str(REPO / plot)] if plot else [])])
        out("| " + " | ".join(columns.values()) + " |")
        out("|" + "---|" * len(columns))
        for row in rows:
            out("| " + " | ".join(_cell(row.get(k, "")) for k in columns) + " |")
        out("")
        out(f"Measured by `.venv/bin/python scripts/{script}.py {shlex.join(argv)}`.")

    _part(example, sources_of(example, f"scripts/{script}.py", "scripts/benchlib.py", *extra), write, threads,
          f"{script} {' '.join(argv)}")


ROWS = "# pages.py rows: "


def _rows(script: str, argv: list[str]) -> list[dict]:
    """``scripts/<script>.py``'s ``main(argv)``, in a process of its own, as a user runs it: a rank's peak
    memory would otherwise start at this long-lived generator's (Linux keeps ``ru_maxrss`` across the
    exec of a spawned process), and a run would see what the one before it left in its modules."""
    code = (f"import json, sys; sys.path[:0] = [{str(REPO / 'scripts')!r}, {str(REPO)!r}]; import {script}; "
            f"print({ROWS!r} + json.dumps({script}.main(json.loads(sys.argv[1])), default=str))")
    done = subprocess.run([sys.executable, "-c", code, json.dumps(argv)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    print(done.stdout, end="")
    if done.returncode:
        raise RuntimeError(f"scripts/{script}.py {' '.join(argv)} exited {done.returncode}")
    return json.loads(next(line for line in reversed(done.stdout.splitlines()) if line.startswith(ROWS))[len(ROWS):])


def timings(commands: Sequence[str]) -> None:
    """Each command's wall time, run one after another (the examples' own default runs)."""
    def write(out) -> None:
        out("| command | wall time |")
        out("|---|---|")
        for command in commands:
            start = datetime.datetime.now()
            run(command, timeout=1800)
            seconds = (datetime.datetime.now() - start).total_seconds()
            out(f"| `{command}` | {seconds:.1f} s |" if seconds < 120 else f"| `{command}` | {seconds / 60:.1f} min |")

    _part("all", ["rpc_rl", "rpc_rnn", "ddp_rpc", "rpc_pipeline_resnet", "pipelining_transformer", "distkit"],
          write, "each command's default threads (cores / processes)")


def picture(example: str, name: str, alt: str) -> None:
    """A picture from scripts/make_pictures.py, drawn into docs/pictures/ by this run."""
    def write(out) -> None:
        import make_pictures

        make_pictures.main(["--only", name, "--out", str(REPO / "docs" / "pictures")])
        out(f"![{alt}]({os.path.relpath(REPO / 'docs' / 'pictures' / name, Path(_cog().inFile).parent)})")

    _part(example, sources_of(example, "scripts/make_pictures.py", "scripts/stagetrace.py", *REFERENCES[example]),
          write, "1 thread a process")


# where make_pictures takes each example's one-process curve from: the tests' own reference
REFERENCES = {"rpc_rl": ["tests/test_rpc_rl.py"], "ddp_rpc": ["tests/test_ddp_rpc.py"], "rpc_rnn": ["tests/test_rpc_rnn.py"],
              "rpc_pipeline_resnet": ["tests/test_resnet_two_pipelines.py"],
              "pipelining_transformer": ["tests/test_pipelining_transformer.py"]}


def gpu() -> None:
    """The GPU tier's table as scripts/gpu_check.py last recorded it on a GPU: its record, results/gpu.json
    (git-ignored), is copied to docs/results/gpu.json where newer (only this generator writes docs/), and
    shown from there: the sitting, a row a case, and, where the code it ran has changed since, that it was
    not re-run (no GPU at hand here)."""
    import shutil

    cog = _cog()
    if _kept("gpu"):
        cog.out(cog.previous)
        found = PART.search(cog.previous)
        _seen.setdefault(cog.inFile, []).append(
            (_heading(), json.loads(found.group(1))["sitting"] if found else "not generated"))
        return
    recorded = REPO / "results" / "gpu.json"
    if recorded.is_file() and (not GPU_RESULTS.is_file() or recorded.stat().st_mtime > GPU_RESULTS.stat().st_mtime):
        GPU_RESULTS.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(recorded, GPU_RESULTS)
    record = json.loads(GPU_RESULTS.read_text())
    where = (f"{record['machine']}, {record['cores']} cores, torch {record['torch']}, Python {record['python']}, "
             f"commit {record['commit']}, {record['date']}")
    cog.outl(f"{where}:")
    cog.outl("")
    cog.outl("| case | GPUs | result | s |")
    cog.outl("|---|---|---|---|")
    for case in record["cases"]:  # a case is a test's name: a docs page names none, hence no test_ prefix
        seconds = "" if case["seconds"] is None else f"{case['seconds']:.1f}"
        cog.outl(f"| `{case['case'].removeprefix('test_')}` | {case['gpus']} | {case['result']} | {seconds} |")
    if fingerprint(record["sources"], record["torch"]) != record["fingerprint"]:
        cog.outl("")
        cog.outl(f"{NOT_RERUN} commit {record['commit']}: the code has changed since, and no GPU was at hand.")
    meta = {"example": "gpu", "sources": record["sources"], "torch": record["torch"],
            "fingerprint": record["fingerprint"], "sitting": where, "gpu": True}
    cog.outl(f"<!-- part: {json.dumps(meta)} -->")
    _seen.setdefault(cog.inFile, []).append((_heading(), where))


def sitting_line() -> None:
    """The page's last block: the sitting of its parts, named once where they share one."""
    seen = _seen.pop(_cog().inFile, [])
    sittings = list(dict.fromkeys(s for _, s in seen))
    if len(sittings) == 1:
        _cog().outl(f"*Generated by `scripts/pages.py`: {sittings[0]}.*")
    elif sittings:
        _cog().outl("*Generated by `scripts/pages.py`:*")
        _cog().outl("")
        for s in sittings:
            where = ", ".join(dict.fromkeys(f"*{h}*" for h, t in seen if t == s))
            _cog().outl(f"- {where}: {s}.")


def _cell(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:,.0f}"
    return str(v)


# ---- running a command, and the rule for what a block shows ----

def argv_of(command: str) -> list[str]:
    """A page's command as this interpreter runs it (the pages show the venv's ``.venv/bin/...``)."""
    words = shlex.split(command)
    if words[0].endswith("bin/python"):
        return [sys.executable, *words[1:]]
    if words[0].endswith("bin/torchrun"):
        return [sys.executable, "-m", "torch.distributed.run", *words[1:]]
    return words


def run(command: str, timeout: float = 300) -> str:
    """``command``'s stdout, from the repo's root; an error with its output if it fails."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DISTKIT_", "PAGES_"))}
    done = subprocess.run(argv_of(command), cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"{command} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done.stdout


RANK = re.compile(r"^(\[rank \d+\] )")
ELIDED = "..."


def _stream(line: str) -> str:
    found = RANK.match(line)
    return found.group(1) if found else ""


def shown(lines: Sequence[str], head: int | None, tail: int | None) -> list[str]:
    """What a block keeps of ``lines``: each rank's first ``head`` and last ``tail`` lines (None: all),
    in the order printed, with one ``[rank N] ...`` where that rank's lines were left out; every line of
    no rank (what ``main`` prints once the ranks are done)."""
    by_stream: dict[str, list[int]] = {}
    for i, line in enumerate(lines):
        by_stream.setdefault(_stream(line), []).append(i)
    kept: set[int] = set()
    elided: dict[int, str] = {}
    for prefix, idx in by_stream.items():
        if not prefix or head is None or tail is None or len(idx) <= head + tail:
            kept.update(idx)
            continue
        kept.update(idx[:head] + idx[len(idx) - tail:])
        elided[idx[head]] = prefix + ELIDED
    return [elided[i] if i in elided else lines[i] for i in range(len(lines)) if i in kept or i in elided]


TIME = re.compile(r"(?<=time = )\d+(?:\.\d+)?(?:e-?\d+)?|\b\d+(?:\.\d+)?\s?(?:ms|s|min)\b")
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def same(block: Sequence[str], printed: Sequence[str], units: int = UNITS) -> list[str]:
    """Where ``printed`` (a run's lines, as ``shown`` keeps them) differs from ``block``: each rank's lines
    in order, whatever the interleaving; a time matches any time; an integer matches itself, a decimal
    number matches within ``units`` of its last printed digit; the rest of a line, character for character."""
    def streams(lines: Sequence[str]) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for line in lines:
            out.setdefault(_stream(line), []).append(line)
        return out

    problems = []
    want, got = streams(block), streams(printed)
    for prefix in sorted(set(want) | set(got)):
        w, g = want.get(prefix, []), got.get(prefix, [])
        if len(w) != len(g):
            problems.append(f"{prefix or 'unprefixed'}: {len(w)} lines shown, {len(g)} printed:\n  {g}")
            continue
        problems += [f"shown {a!r}\nprinted {b!r}" for a, b in zip(w, g) if not _same_line(a, b, units)]
    return problems


def _same_line(a: str, b: str, units: int) -> bool:
    a, b = TIME.sub("<time>", a), TIME.sub("<time>", b)
    if NUMBER.sub("#", a) != NUMBER.sub("#", b):
        return False
    for x, y in zip(NUMBER.findall(a), NUMBER.findall(b)):
        if not any(c in x + y for c in ".e"):
            if x != y:
                return False
        elif abs(float(x) - float(y)) > units * _unit(x) * (1 + 1e-9):
            return False
    return True


def _unit(number: str) -> float:
    """The value of one unit in ``number``'s last printed digit (0.0554: 0.0001; 1.5e-3: 0.0001)."""
    mantissa, _, exponent = number.lower().partition("e")
    decimals = len(mantissa.partition(".")[2])
    return 10.0 ** (int(exponent or 0) - decimals)


# ---- reading a page's parts back (tests/test_generated.py) ----

BLOCK = re.compile(r"^.*\[\[\[cog (?P<code>.*?)\]\]\].*\n(?P<out>(?:.*\n)*?).*\[\[\[end\]\]\](?: \(sum: (?P<sum>\S+)\))?",
                   re.M)


def parts(md: Path) -> list[dict]:
    """Each generated part of ``md``: its call (function name, arguments), its text, its hidden line's
    fields, its checksum as written and as its text gives it."""
    found = []
    for m in BLOCK.finditer(md.read_text()):
        call = ast.parse(m.group("code").strip(), mode="eval").body
        meta = PART.search(m.group("out"))
        digest = base64.b64encode(hashlib.md5(m.group("out").encode()).digest()).decode()[:10]
        found.append({"call": ast.unparse(call.func) if isinstance(call, ast.Call) else "",
                      "args": [ast.literal_eval(a) for a in call.args] if isinstance(call, ast.Call) else [],
                      "kwargs": {k.arg: ast.literal_eval(k.value) for k in call.keywords}
                      if isinstance(call, ast.Call) else {},
                      "text": m.group("out"), "meta": json.loads(meta.group(1)) if meta else None,
                      "sum": m.group("sum"), "digest": digest, "line": md.read_text()[:m.start()].count("\n") + 1})
    return found


def refresh_command(md: Path, example: str | None = None) -> str:
    return f".venv/bin/python scripts/pages.py {example or md.relative_to(REPO)}"


# ---- the command ----

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", nargs="*", metavar="PAGE_OR_EXAMPLE",
                   help=f"pages (paths), or one example ({', '.join(EXAMPLES)}, gpu) whose parts to regenerate "
                        "on every page; default: every part of every page")
    return p


def main(argv: list[str] | None = None) -> int:
    from cogapp import Cog

    parser = build_parser()
    args = parser.parse_args(argv)
    examples = [w for w in args.what if w in (*EXAMPLES, "gpu")]
    files = [str(Path(w).resolve()) for w in args.what if w not in examples]
    if len(examples) > 1 or (examples and files):
        parser.error("give pages, or one example")
    for f in files:
        if not Path(f).is_file():
            parser.error(f"no such page: {f}")
    if examples:
        os.environ[ONLY] = examples[0]
    targets = files or [str(p) for p in pages()]
    sys.path.insert(0, str(REPO / "scripts"))
    sys.path.insert(0, str(REPO))
    os.chdir(REPO)
    start = datetime.datetime.now()
    status = Cog().main(["cog", "-r", "-c", "-p", "import pages", *targets])
    failed = sys.modules["pages"]._failed if "pages" in sys.modules else []
    if failed:
        print(f"# pages.py: these parts' runs failed, kept as they were: {', '.join(failed)}", file=sys.stderr)
        status = status or 1
    print(f"# pages.py: {len(targets)} page(s) in {(datetime.datetime.now() - start).total_seconds():.0f} s",
          file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
