"""scripts/resnet_precision.py, whose figures docs/results.md gives for the GPU tier's ResNet case: on this
CPU, float32's first loss agrees with float64's (a forward), its loss after a step far less (the step
carries the BatchNorm gradients' rounding), which is why tests/test_cuda.py compares the two apart."""
from __future__ import annotations

import re

from conftest import run_cli


def test_float32_is_near_float64_before_a_step_and_further_after_it():
    proc = run_cli("scripts/resnet_precision.py", "--quick", timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = re.findall(r"float32, (\d) thread\(s\): losses \S+ \S+, (\S+) % and (\S+) % from float64", proc.stdout)
    assert len(rows) == 4, proc.stdout  # 1 and 2 threads, 1 and 2 micro-batches
    for _, first, after in rows:
        assert float(first) < 1e-2  # percent: float32's rounding of a forward, within 1e-4
        assert float(after) > 10 * float(first), proc.stdout
    assert len(re.findall(r"first gradients x \(1 \+ \S+ noise\): second loss \S+ % from float64", proc.stdout)) == 8
