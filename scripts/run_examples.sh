#!/usr/bin/env bash
# Run every example once in its quick CPU configuration (a few minutes on 2 cores).
# Stops at the first example that fails. PYTHON overrides the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3

run() { echo; echo "=== $*"; "$@"; }

run "$PY" rpc_rl/main.py --world_size 3 --reward_threshold 100
run "$PY" ddp_rpc/main.py
run "$PY" rpc_rnn/main.py
run "$PY" rpc_pipeline_resnet/main.py
run "$PY" rpc_pipeline_resnet/pipelining.py --world_size 2   # the same model, torch.distributed.pipelining
# The tutorial launches this one with `torchrun --nproc_per_node 2`, which works the same,
# but torchrun's store listens on every network interface; distkit's launcher listens on
# loopback only, so a laptop running the quick start opens nothing to the network.
run "$PY" pipelining_transformer/main.py --world_size 2
