#!/usr/bin/env bash
# lossparity's two commands: `./dev.sh main` (the main job) and `./dev.sh test` (static checks, then the whole test
# suite). Also: `./dev.sh test --fast` (the single-process tests alone), `./dev.sh lint` (the static checks alone),
# `./dev.sh wheel` (build the wheel and test it installed), `./dev.sh docs` (build the API reference site).
# Each does its own set-up: creates or reuses ./.venv, installs the project, and installs the CPU build
# torch==2.13.0 only when no torch is importable (a bare `torch` requirement would pull a CUDA build).
set -euo pipefail
cd "$(dirname "$0")"
VENV="${LOSSPARITY_VENV:-.venv}"
PY="${PYTHON:-python3}"

ensure_env() {  # $1 = extras profile: main | test
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    "$VENV/bin/pip" install -q "torch==2.13.0"
  fi
  local stamp="$VENV/.lossparity-$1-$(cat pyproject.toml dev.sh | sha1sum | cut -c1-12)"
  [ -f "$stamp" ] && return 0
  if [ "$1" = test ]; then
    # hf/trl: the Hugging Face Trainer and TRL integrations (their tests build tiny models from configs).
    "$VENV/bin/pip" install -q -e ".[dev,report,tensorboard,jax,jax-test,config,hf,trl,docs]"
    # megatron-core is the oracle of the MoE tests; --no-deps keeps it from touching torch.
    "$VENV/bin/pip" install -q --no-deps "megatron-core==0.16.1"
    # torchtitan 0.3.0 pins datasets<4.8 and pulls wandb/torch_checkpointing that its trainer module does not
    # need: install it and the modules it imports without their dependencies (torch stays as installed).
    # torchtitan.trainer imports triton (CPU runs never call it).
    "$VENV/bin/pip" install -q --no-deps "torchtitan==0.3.0" "spmd_types==0.2.3" "torchdata==0.11.0" "triton==3.9.0"
    "$VENV/bin/pip" install -q tyro einops
  else
    "$VENV/bin/pip" install -q -e .
  fi
  touch "$stamp"
}

MAXTEXT_VENV="${LOSSPARITY_MAXTEXT_VENV:-.venv-maxtext}"
ensure_maxtext_env() {  # Python 3.12 venv with MaxText 0.2.5 on CPU and lossparity without torch (tests/maxtext)
  if [ ! -x "$MAXTEXT_VENV/bin/python" ]; then
    local c py=""  # a Python 3.12: $PYTHON312, python3.12 on PATH, or a pyenv-installed 3.12
    for c in "${PYTHON312:-}" python3.12 "$(pyenv root 2>/dev/null || echo /nonexistent)"/versions/3.12*/bin/python3.12; do
      if [ -n "$c" ] && "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then py="$c"; break; fi
    done
    [ -n "$py" ] || { echo "dev.sh: MaxText 0.2.5 needs Python 3.12 (set PYTHON312)" >&2; exit 2; }
    "$py" -m venv "$MAXTEXT_VENV"
  fi
  local stamp="$MAXTEXT_VENV/.lossparity-maxtext-$(cat requirements/maxtext-cpu.txt pyproject.toml | sha1sum | cut -c1-12)"
  [ -f "$stamp" ] && return 0
  # pinned closure, --no-deps: maxtext 0.2.5 declares its dependencies only behind accelerator extras
  "$MAXTEXT_VENV/bin/pip" install -q --no-deps -r requirements/maxtext-cpu.txt
  "$MAXTEXT_VENV/bin/pip" install -q --no-deps -e .  # lossparity.jax / lossparity.maxtext import no torch
  touch "$stamp"
}

maxtext_tests() {  # the MaxText tests, for real, in the 3.12 venv (the main run skips tests/maxtext)
  ensure_maxtext_env
  DECOUPLE_GCLOUD=TRUE JAX_PLATFORMS=cpu LOSSPARITY_REQUIRE_MAXTEXT=1 \
    "$MAXTEXT_VENV/bin/python" -m pytest -q -p no:cacheprovider tests/maxtext
}

lint() {  # static checks of the test command: lint (with complexity limits), formatting, types, layers
  "$VENV/bin/ruff" check .
  "$VENV/bin/ruff" format --check .
  "$VENV/bin/mypy"
  "$VENV/bin/lint-imports" --no-cache  # the import layers of docs/architecture.md (pyproject.toml)
  "$VENV/bin/python" scripts/check_sizes.py  # no file over 600 lines, no class over 350
}

cmd="${1:-main}"
shift || true
case "$cmd" in
  main)
    ensure_env main
    "$VENV/bin/lossparity" verify "$@"
    ;;
  lint)
    ensure_env test
    lint
    ;;
  wheel)  # the built package: sdist + wheel, twine check, fresh-venv install, three commands (CI runs it)
    ensure_env test
    bash scripts/check_wheel.sh "$VENV"
    ;;
  docs)  # the API reference site into ./site (mkdocs.yml); --strict: a broken link or reference fails
    ensure_env test
    NO_MKDOCS_2_WARNING=1 "$VENV/bin/mkdocs" build --strict --quiet "$@"
    ;;
  test)
    ensure_env test
    if [ "${1:-}" = "--fast" ]; then  # the quick loop: single-process tests only, no static checks
      shift
      "$VENV/bin/python" -m pytest -q -m "not slow and not multiprocess and not frameworks" "$@"
    else
      lint
      "$VENV/bin/python" -m pytest -q "$@"
      maxtext_tests
    fi
    ;;
  maxtext-test)
    maxtext_tests
    ;;
  *)
    echo "usage: ./dev.sh main|test|lint|wheel|docs|maxtext-test [args...]" >&2
    exit 2
    ;;
esac
