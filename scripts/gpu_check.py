"""The whole GPU check, for a person with a GPU: the GPU tier (tests/test_cuda.py, ``-m cuda``), then each
example's README command with ``--device cuda`` where the visible GPUs allow it, then one table: a row a
case, the GPUs it needs, passed / failed / skipped (why), seconds; then, on a GPU, the ResNet case's float32
losses beside float64 (scripts/resnet_precision.py). Exits 1 if anything failed.

The table is also recorded as JSON (results/gpu.json where a GPU ran the tier, or ``--record PATH``): the
machine, torch, Python, the commit, the date, what the tier ran and its fingerprint (scripts/pages.py's), and
each case. scripts/pages.py shows the newest record on docs/results.md.

    python scripts/gpu_check.py               # on the GPU machine, from the repository root
    python scripts/gpu_check.py --tier cpu    # the same harness on the CPU (the tier's cpu cases)
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import pages  # noqa: E402

RECORD = Path("results") / "gpu.json"  # from the repository's root; git ignores results/
SOURCES = [*pages.EXAMPLES, "distkit", "tests/test_cuda.py", "scripts/gpu_check.py"]  # what the GPU tier runs
NCCL = "NCCL: one GPU per process"
COMMAND_TIMEOUT = 900  # s: the largest README command (ResNet50, batch 128) takes about a minute on a GPU


@dataclass
class Row:
    case: str
    gpus: int | str
    result: str
    seconds: float


def tier_rows(tier: str, junit: Path, cases: str | None) -> list[Row]:
    """The GPU tier's cases (``tier`` cpu: the same cases' cpu tier, every GPU hidden), from pytest's junit XML."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if tier == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    # -n 0: one case at a time, each with every GPU it asks for; -p no:cacheprovider: nothing left behind
    subprocess.run([sys.executable, "-m", "pytest", "tests/test_cuda.py", "-m", "cuda" if tier == "cuda" else "not cuda",
                    "-n", "0", "-p", "no:cacheprovider", "-q", f"--junitxml={junit}", *(["-k", cases] if cases else [])],
                   cwd=REPO, env=env)
    rows = []
    for case in ET.parse(junit).iter("testcase"):
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        outcome = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        if outcome is None:
            result = "passed"
        elif outcome.tag == "skipped":
            result = "skipped: " + (outcome.get("message") or "").removeprefix("Skipped: ")
        else:
            result = "failed: " + ((outcome.get("message") or "").splitlines() or [""])[0][:100]
        rows.append(Row(case.get("name", "?"), props.get("gpus", "?"), result, float(case.get("time", 0))))
    return rows


def readme_commands(gpus: int) -> list[tuple[str, int, list[str] | None, str]]:
    """Each README command with --device cuda: (what, GPUs it needs, argv or None, why not run)."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    py = [sys.executable]
    cmds: list[tuple[str, int, list[str] | None, str]] = [
        ("python rpc_rl/main.py --world_size 3", 0, None, "skipped: runs on the CPU (CartPole; no --device)")]
    # (script, as its README launches it: under torchrun?, GPUs the README's command needs, its flags on one GPU)
    for script, under_torchrun, ranks, one_gpu in [
        ("rpc_rnn/main.py", False, 1, None),
        ("ddp_rpc/main.py", False, 2, ["--world_size", "3"]),  # 2 trainers, a GPU each (NCCL); or 1 trainer
        ("rpc_pipeline_resnet/main.py", False, 1, None),  # both shards on cuda:0, or a GPU each
        ("rpc_pipeline_resnet/pipelining.py", True, 2, None),  # a stage per rank, a GPU each
        ("pipelining_transformer/main.py", True, 2, []),  # on one GPU: one rank, every stage
        ("ddp_rpc/sharded.py", True, 2, []),
        ("rpc_rnn/sharded.py", True, 2, []),
    ]:
        need, extra = (ranks, []) if gpus >= ranks else (1, one_gpu)
        if extra is None or gpus < need:
            why = f"needs {ranks} GPU(s), {gpus} visible" + (f": {NCCL}" if ranks > 1 else "")
            cmds.append((f"{script} --device cuda", ranks, None, f"skipped: {why}"))
            continue
        launch = [*torchrun, f"--nproc_per_node={need}"] if under_torchrun else py
        shown = f"torchrun --nproc_per_node {need}" if under_torchrun else "python"
        cmds.append((" ".join([shown, script, *extra, "--device cuda"]), need, [*launch, script, *extra, "--device", "cuda"], ""))
    return cmds


def command_rows(gpus: int) -> list[Row]:
    rows = []
    for what, need, argv, why in readme_commands(gpus):
        if argv is None:
            rows.append(Row(what, need, why, 0.0))
            continue
        start = time.perf_counter()
        try:
            # PYTHONPATH: the examples import distkit also where the repository was not pip-installed
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
            proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=COMMAND_TIMEOUT, env=env)
            ok, tail = proc.returncode == 0, (proc.stderr.strip().splitlines() or [""])[-1]
            result = "passed" if ok else f"failed: exit {proc.returncode}: {tail[:100]}"
            if not ok:
                print(f"--- {what}\n{proc.stdout}{proc.stderr}", file=sys.stderr)
        except subprocess.TimeoutExpired:
            result = f"failed: no exit within {COMMAND_TIMEOUT} s"
        rows.append(Row(what, need, result, time.perf_counter() - start))
    return rows


def gpu_names() -> str:
    """The visible GPUs and their driver, e.g. ``2 x NVIDIA H200 (driver 580.159.04)``; or ``no GPU``."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.device_count()):
        return "no GPU"
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True)
    if smi.returncode or not smi.stdout.strip():
        return torch.cuda.get_device_name(0)
    kinds: dict[str, int] = {}
    for line in smi.stdout.strip().splitlines():
        name, _, driver = line.rpartition(", ")
        kind = f"{name} (driver {driver})"
        kinds[kind] = kinds.get(kind, 0) + 1
    return "; ".join(kind if n == 1 else f"{n} x {kind}" for kind, n in kinds.items())


def machine() -> str:
    import torch

    return f"{gpu_names()}; torch {torch.__version__}; Python {platform.python_version()}; {os.cpu_count()} cores"


def commit() -> str:
    """This checkout's commit, ``+modified`` where its code (not a page) differs from it."""
    git = ["git", "-C", str(REPO)]
    try:
        sha = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no", "--", ".", ":!*.md",
                                ":!docs/"], capture_output=True, text=True).stdout.strip()
    except OSError:  # no git on the GPU machine
        return "unknown"
    return f"{sha}+modified" if sha and dirty else sha or "unknown"


def record_path(given: str | None, tier: str, gpus: int) -> Path | None:
    """Where the record goes: ``--record``'s path; else results/gpu.json where a GPU ran the tier (a CPU
    run is no GPU sitting: recorded there, pages.py would show it as one)."""
    if given:
        return Path(given)
    return REPO / RECORD if tier == "cuda" and gpus else None


def write_record(rows: list[Row], path: Path) -> dict:
    """The table as JSON at ``path``, with the sitting and the fingerprint of what the tier ran."""
    import torch

    cases = [{**dataclasses.asdict(r), "gpus": int(r.gpus) if str(r.gpus).isdigit() else r.gpus,
              "seconds": round(r.seconds, 1)} for r in rows]
    record = {"machine": gpu_names(), "torch": torch.__version__, "python": platform.python_version(),
              "cores": os.cpu_count(), "commit": commit(), "date": datetime.date.today().isoformat(),
              "sources": SOURCES, "fingerprint": pages.fingerprint(SOURCES, torch.__version__), "cases": cases}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tier", choices=["cuda", "cpu"], default="cuda",
                        help="cuda: the GPU tier and the README commands; cpu: the tier's cpu cases only")
    parser.add_argument("--cases", metavar="EXPR", help="only the tier's cases pytest -k EXPR selects")
    parser.add_argument("--no_commands", action="store_true", help="the tier only, not the README commands")
    parser.add_argument("--record", metavar="PATH", default=None,
                        help=f"write the table as JSON here (default: {RECORD} where a GPU ran the tier, "
                             "else nothing)")
    args = parser.parse_args(argv)
    import torch

    gpus = torch.cuda.device_count() if args.tier == "cuda" and torch.cuda.is_available() else 0
    with tempfile.TemporaryDirectory() as tmp:
        rows = tier_rows(args.tier, Path(tmp) / "junit.xml", args.cases)
    if args.tier == "cuda" and not args.no_commands:
        rows += command_rows(gpus)
    print(f"\n{machine()}")
    width = max((len(r.case) for r in rows), default=len("case"))  # no row: the tier ran nothing
    print(f"{'case':<{width}}  GPUs  {'seconds':>7}  result")
    for r in rows:
        print(f"{r.case:<{width}}  {r.gpus!s:>4}  {r.seconds:7.1f}  {r.result}")
    if path := record_path(args.record, args.tier, gpus):
        write_record(rows, path)
        print(f"recorded in {path}")
    if gpus:  # what settles the ResNet case's float32 question (docs/results.md): this GPU beside float64
        print("\n--- scripts/resnet_precision.py --device cuda (for docs/results.md, 'On a GPU')", flush=True)
        subprocess.run([sys.executable, "scripts/resnet_precision.py", "--device", "cuda"], cwd=REPO)
    failed = [r for r in rows if r.result.startswith("failed")]
    skipped = sum(r.result.startswith("skipped") for r in rows)
    print(f"GPU check: {len(rows) - len(failed) - skipped} passed, {skipped} skipped, {len(failed)} failed")
    return 1 if failed or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
