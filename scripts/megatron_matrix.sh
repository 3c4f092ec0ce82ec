#!/usr/bin/env bash
# The full Megatron pipeline matrix on both megatron-core releases (CI runs a subset of it, see dev.sh):
# per_token and per_sample × calculate_per_token_loss True/False × aux scopes microbatch/global_lagged on
# PP2, PP2×VPP2, DP2×PP2 and TP2+SP×PP2, against the hand-written objective, plus the expert-bias case.
# Prints docs/megatron.md's table: one row per case, the worst relative gradient difference over both steps
# and every rank under each release (the test's `table row:` lines, joined), then each release's pytest line.
# Exits 1 when either run fails.
# Usage: scripts/megatron_matrix.sh   (after ./dev.sh test has created .venv and .venv-megatron)
set -euo pipefail
cd "$(dirname "$0")/.."
logs="$(mktemp -d)"
trap 'rm -rf "$logs"' EXIT
status=0
versions=()
for py in "${LOSSPARITY_VENV:-.venv}/bin/python" "${LOSSPARITY_MEGATRON_VENV:-.venv-megatron}/bin/python"; do
  v="$("$py" -c 'import importlib.metadata as m; print(m.version("megatron-core"))')"
  versions+=("$v")
  LOSSPARITY_MEGATRON_FULL=1 "$py" -m pytest -q -s -p no:cacheprovider \
    tests/integrations/test_integration_megatron_schedules.py >"$logs/$v.log" 2>&1 || status=1
  "$py" -c 'import sys; print("megatron-core", sys.argv[1], "Python", sys.version.split()[0])' "$v" >"$logs/$v.head"
  grep -E "passed|failed|error" "$logs/$v.log" | tail -1 >>"$logs/$v.head" || echo "no pytest summary" >>"$logs/$v.head"
done
echo "| layout | mode | scope | per-token loss | gradients ${versions[0]} | gradients ${versions[1]} |"
echo "|---|---|---|---|---|---|"
# join on the first four cells, in the first release's order; a case missing under a release shows "-"
awk -F' [|] ' '
  FNR == 1 { file++ }
  /^table row: / {
    key = $2 " | " $3 " | " $4 " | " $5
    val = $6; sub(/ [|]$/, "", val)
    if (file == 1) { order[++n] = key }
    cell[file, key] = val
  }
  END { for (i = 1; i <= n; i++) { k = order[i]; b = ((2, k) in cell) ? cell[2, k] : "-"; print "| " k " | " cell[1, k] " | " b " |" } }
' "$logs/${versions[0]}.log" "$logs/${versions[1]}.log"
echo
cat "$logs/${versions[0]}.head" "$logs/${versions[1]}.head"
exit "$status"
