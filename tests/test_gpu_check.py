"""scripts/gpu_check.py, the GPU owner's one command, on the CPU: its table from the GPU tier's own cases
(their cpu tier), the README commands it would run for 0, 1 and 2 GPUs, and the table's JSON record."""
from __future__ import annotations

import json
import os
import re
import sys

import torch

from conftest import REPO, run_cli

sys.path.insert(0, str(REPO / "scripts"))
import gpu_check  # noqa: E402
import pages  # noqa: E402


def test_the_table_has_a_row_per_case_with_its_gpus_result_and_seconds():
    proc = run_cli("scripts/gpu_check.py", "--tier", "cpu", "--cases", "sharded_table or pipelining_stage", timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = re.findall(r"^(test_\S+)\s+(\d+)\s+(\d+\.\d)\s+(passed)$", proc.stdout, re.M)
    assert [(case, gpus) for case, gpus, *_ in rows] == [  # the GPUs each case's GPU tier needs
        ("test_ddp_rpc_sharded_table_on_gpus[cpu]", "1"),
        ("test_rpc_pipeline_resnet_pipelining_stage_per_gpu[cpu]", "2")], proc.stdout
    assert "GPU check: 2 passed, 0 skipped, 0 failed" in proc.stdout, proc.stdout


def test_each_readme_command_runs_where_the_gpus_allow_it():
    def commands(gpus: int) -> dict[str, str]:
        return {what: why or " ".join(argv[argv.index(next(a for a in argv if a.endswith(".py"))):])
                for what, _, argv, why in gpu_check.readme_commands(gpus)}

    none = commands(0)
    assert all(why.startswith("skipped") for why in none.values()), none
    one, two = commands(1), commands(2)
    assert one["python ddp_rpc/main.py --world_size 3 --device cuda"] == "ddp_rpc/main.py --world_size 3 --device cuda"
    assert "needs 2 GPU(s), 1 visible: NCCL" in one["rpc_pipeline_resnet/pipelining.py --device cuda"]
    assert "torchrun --nproc_per_node 1 pipelining_transformer/main.py --device cuda" in one
    assert "torchrun --nproc_per_node 2 rpc_pipeline_resnet/pipelining.py --device cuda" in two
    assert "python ddp_rpc/main.py --device cuda" in two
    assert one["python rpc_rl/main.py --world_size 3"].startswith("skipped: runs on the CPU")


def test_a_failed_case_makes_the_check_exit_1(monkeypatch, capsys):
    """The GPU owner reads the exit status first: one failed row is exit 1, all passed or skipped 0."""
    rows = [gpu_check.Row("test_a[cuda]", 1, "passed", 1.0), gpu_check.Row("test_b[cuda]", 2, "skipped: NCCL", 0.0)]
    monkeypatch.setattr(gpu_check, "tier_rows", lambda *args: list(rows))
    assert gpu_check.main(["--tier", "cpu"]) == 0
    rows.append(gpu_check.Row("test_c[cuda]", 1, "failed: loss 0.4 % off", 2.0))
    assert gpu_check.main(["--tier", "cpu"]) == 1
    assert "GPU check: 1 passed, 1 skipped, 1 failed" in capsys.readouterr().out
    monkeypatch.setattr(gpu_check, "tier_rows", lambda *args: [])
    assert gpu_check.main(["--tier", "cpu"]) == 1  # nothing ran: not a pass


def test_the_table_is_recorded_as_json_with_its_sitting_and_fingerprint(monkeypatch, tmp_path):
    """scripts/pages.py shows the record on docs/results.md, and says it is not re-run once the fingerprint
    of what the tier ran is another's: the record names those sources and their fingerprint."""
    rows = [gpu_check.Row("test_a[cuda-1]", "1", "passed", 1.04), gpu_check.Row("python x.py", 2, "skipped: NCCL", 0.0)]
    monkeypatch.setattr(gpu_check, "tier_rows", lambda *args: list(rows))
    path = tmp_path / "gpu.json"
    assert gpu_check.main(["--tier", "cpu", "--record", str(path)]) == 0
    record = json.loads(path.read_text())
    assert record["cases"] == [{"case": "test_a[cuda-1]", "gpus": 1, "result": "passed", "seconds": 1.0},
                               {"case": "python x.py", "gpus": 2, "result": "skipped: NCCL", "seconds": 0.0}]
    assert record["sources"] == ["rpc_rl", "rpc_rnn", "ddp_rpc", "rpc_pipeline_resnet", "pipelining_transformer",
                                 "distkit", "tests/test_cuda.py", "scripts/gpu_check.py"]
    assert record["fingerprint"] == pages.fingerprint(record["sources"], torch.__version__)
    assert (record["machine"], record["torch"], record["cores"]) == (gpu_check.gpu_names(), torch.__version__,
                                                                     os.cpu_count())
    assert re.fullmatch(r"[0-9a-f]{7,}(\+modified)?", record["commit"]), record["commit"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", record["date"]), record["date"]
    # without --record, only a GPU's run is recorded (at results/gpu.json): a CPU run is no GPU sitting
    assert gpu_check.record_path(None, "cpu", 0) is None and gpu_check.record_path(None, "cuda", 0) is None
    assert gpu_check.record_path(None, "cuda", 1) == REPO / "results" / "gpu.json"
