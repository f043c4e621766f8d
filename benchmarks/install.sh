#!/usr/bin/env bash
# The benchmark's own environment: TRL 1.12.0 (the last release with PPO) on torch 2.13.0 (CPU), in a venv
# separate from the library's (.venv), so ppojax never depends on trl.
#   bash benchmarks/install.sh            # creates/reuses .venv-bench in the repository root
#   BENCH_VENV=/path bash benchmarks/install.sh
# torch is installed FIRST and pinned: an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${BENCH_VENV:-.venv-bench}"
test -x "$VENV/bin/python" || python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q trl==1.12.0
"$VENV/bin/python" -c "import torch, trl, transformers; from trl.experimental.ppo import PPOTrainer; \
print('benchmark venv ready:', '$VENV', 'torch', torch.__version__, 'trl', trl.__version__, 'transformers', transformers.__version__)"
