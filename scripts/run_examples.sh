#!/usr/bin/env bash
# Six runs in a quick CPU configuration: the five examples, and rpc_pipeline_resnet's model again with
# torch.distributed.pipelining (how long: docs/results.md). Stops at the first run that fails. PYTHON
# overrides the interpreter. Each run's line says how long the script has taken so far, and a script
# stopped from outside (timeout, Ctrl+C) says where it was: a limit shorter than the whole script
# looks like a stall (docs/failures.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
SETUP="python3 -m venv .venv && .venv/bin/pip install -c constraints.txt -e ."
# without the README's venv, a python3 without torch would fail with a traceback: say what to run first
if [[ -z "${PYTHON:-}" ]] && ! { [ -x "$PY" ] && "$PY" -c "import torch, gymnasium" 2>/dev/null; }; then
    echo "run_examples.sh: no usable .venv here; run the README's set-up first: $SETUP" >&2
    exit 2
elif ! command -v "$PY" >/dev/null; then  # a path, or a command on the PATH (PYTHON=python3)
    echo "run_examples.sh: PYTHON=$PY is not an interpreter that can run; unset it, or run first: $SETUP" >&2
    exit 2
fi
TOTAL=$(grep -c "^run " scripts/run_examples.sh)
n=0
now=""

# bash runs a trap once its foreground child is gone; timeout and Ctrl+C signal the examples too
stopped() {
    echo "run_examples.sh: stopped from outside ($1) after ${SECONDS} s, in run $n of $TOTAL: $now" >&2
    exit "$2"
}
trap 'stopped SIGTERM 143' TERM
trap 'stopped SIGINT 130' INT

run() {
    n=$((n + 1)); now="$*"
    echo; echo "=== [$n/$TOTAL, ${SECONDS} s so far] $*"
    "$@"
}

run "$PY" rpc_rl/main.py --world_size 3 --reward_threshold 100
run "$PY" ddp_rpc/main.py
run "$PY" rpc_rnn/main.py
run "$PY" rpc_pipeline_resnet/main.py
run "$PY" rpc_pipeline_resnet/pipelining.py --world_size 2   # the same model, torch.distributed.pipelining
# The tutorial launches this one with `torchrun --nproc_per_node 2`, which works the same,
# but torchrun's store listens on every network interface; the store distkit.prepare_spawn hosts
# for mp.spawn's ranks listens on loopback only, so a laptop running the quick start opens nothing
# to the network.
run "$PY" pipelining_transformer/main.py --world_size 2
echo; echo "=== all $TOTAL runs finished in ${SECONDS} s"
