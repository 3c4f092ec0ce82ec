#!/usr/bin/env bash
# The full Megatron pipeline matrix on both megatron-core releases (CI runs a subset of it, see dev.sh):
# per_token and per_sample × calculate_per_token_loss True/False × aux scopes microbatch/global_lagged on
# PP2, PP2×VPP2, DP2×PP2 and TP2+SP×PP2, against the hand-written objective, plus the expert-bias case.
# Usage: scripts/megatron_matrix.sh   (after ./dev.sh test has created .venv and .venv-megatron)
set -euo pipefail
cd "$(dirname "$0")/.."
for py in "${LOSSPARITY_VENV:-.venv}/bin/python" "${LOSSPARITY_MEGATRON_VENV:-.venv-megatron}/bin/python"; do
  "$py" -c 'import importlib.metadata as m, sys; print("megatron-core", m.version("megatron-core"), "Python", sys.version.split()[0])'
  LOSSPARITY_MEGATRON_FULL=1 "$py" -m pytest -q -s -p no:cacheprovider \
    tests/integrations/test_integration_megatron_schedules.py 2>&1 | grep -E "^measured|passed|failed"
done
