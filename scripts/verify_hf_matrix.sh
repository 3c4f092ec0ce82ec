#!/usr/bin/env bash
# The full `lossparity verify --hf` matrix of docs/verify-your-model.md (by hand, not CI: several minutes on CPU).
# Every row must PASS for the four families; the last command must exit 1 (aux_scope hf fails at K=4).
# Run from the repository root with lossparity and transformers installed (PYTHON overrides the interpreter).
set -u
PY=${PYTHON:-python}
LAYOUTS=K=4,D2xK2,T2,D2+fsdp,K=2+recompute
MODES=per_token,per_sample,per_document
status=0
for model in mixtral qwen3_moe olmoe llama; do
  start=$(date +%s)
  "$PY" -c 'import sys; from lossparity.cli import main; sys.exit(main(sys.argv[1:]))' \
    verify --hf "$model" --layouts "$LAYOUTS" --modes "$MODES" || status=1
  echo "wall $model: $(( $(date +%s) - start )) s"
done
start=$(date +%s)
"$PY" -c 'import sys; from lossparity.cli import main; sys.exit(main(sys.argv[1:]))' \
  verify --hf mixtral --aux-scope hf --layouts K=4 --modes "$MODES"
rc=$?
echo "wall mixtral --aux-scope hf: $(( $(date +%s) - start )) s (exit $rc, expected 1)"
[ "$rc" -eq 1 ] || status=1
exit $status
