#!/usr/bin/env bash
# The full DeepSpeed matrix (CI runs a subset, see tests/integrations/test_integration_deepspeed.py and
# test_hf_deepspeed.py): DeepSpeedAccountant at ZeRO 0/1/2/3 and ZeRO-2/3 with optimizer offload × GA 1/2/4 × every
# mode on 2 gloo ranks, bf16 against float32, plain DeepSpeed through step_gradients, and LossParityTrainer at
# ZeRO-2/3 with and without offload × GA 1/2 × every mode on 1 and 2 processes; each gradient against a one-process
# float64 reference. Prints the measured lines. Usage: scripts/deepspeed_matrix.sh (after ./dev.sh test or lint)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${LOSSPARITY_VENV:-.venv}/bin/python"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}"  # DeepSpeed's compiled ops
"$PY" -c 'import importlib.metadata as m; print(*(f"{p} {m.version(p)}" for p in ("deepspeed", "torch", "transformers", "accelerate")))'
LOSSPARITY_DEEPSPEED_FULL=1 "$PY" -m pytest -q -s -p no:cacheprovider \
  tests/integrations/test_integration_deepspeed.py tests/integrations/test_hf_deepspeed.py 2>&1 |
  grep -E "^measured|passed|failed"
