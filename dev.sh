#!/usr/bin/env bash
# lossparity's two commands: `./dev.sh main` (the main job) and `./dev.sh test` (static checks, then the whole test
# suite in each of its environments: TEST_PARTS below; every part runs, a summary line per part, exit 1 when one
# failed; under CI=true a skip for a missing dependency or missing data is a failure, tests/_ci_skips.py).
# Also: `./dev.sh test --fast` (the single-process tests alone), `./dev.sh lint` (the static checks alone),
# `./dev.sh wheel` (build the wheel and test it installed), `./dev.sh docs` (build the API reference site).
# Each does its own set-up: creates or reuses ./.venv, installs the project, and installs the CPU build
# torch==2.13.0 only when no torch is importable (a bare `torch` requirement would pull a CUDA build).
set -euo pipefail
cd "$(dirname "$0")"
VENV="${LOSSPARITY_VENV:-.venv}"
PY="${PYTHON:-python3}"
# DeepSpeed compiles its CPU ops (the shm communication op at every init_distributed) with g++/ninja on first
# use: cached in the work folder (gitignored .cache/) so that later runs, CI's included, load them.
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}"
CONSTRAINTS=requirements/constraints-test.txt  # the pinned versions of the test environment

ensure_env() {  # $1 = extras profile: main | test
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    "$VENV/bin/pip" install -q "torch==2.13.0"
  fi
  local stamp="$VENV/.lossparity-$1-$(cat pyproject.toml dev.sh "$CONSTRAINTS" | sha1sum | cut -c1-12)"
  [ -f "$stamp" ] && return 0
  if [ "$1" = test ]; then
    # hf/trl: the Hugging Face Trainer and TRL integrations (their tests build tiny models from configs);
    # every version pinned by the constraints file (a new release changes nothing until it does)
    "$VENV/bin/pip" install -q -c "$CONSTRAINTS" -e ".[dev,report,tensorboard,jax,jax-test,config,hf,trl,docs]"
    # megatron-core is the oracle of the MoE tests; --no-deps keeps it from touching torch.
    "$VENV/bin/pip" install -q --no-deps "megatron-core==0.16.1"
    # torchtitan 0.3.0 pins datasets<4.8 and pulls wandb/torch_checkpointing that its trainer module does not
    # need: install it and the modules it imports without their dependencies (torch stays as installed).
    # torchtitan.trainer imports triton (CPU runs never call it).
    "$VENV/bin/pip" install -q --no-deps "torchtitan==0.3.0" "spmd_types==0.2.3" "torchdata==0.11.0" "triton==3.9.0"
    "$VENV/bin/pip" install -q -c "$CONSTRAINTS" tyro einops
    # DeepSpeed: the engine and ZeRO 0-3 tests run it for real on CPU (gloo); pure Python, ops compiled on use.
    "$VENV/bin/pip" install -q -c "$CONSTRAINTS" "deepspeed==0.19.8"
  else
    "$VENV/bin/pip" install -q -e .
  fi
  touch "$stamp"
}

# The Megatron integration tests also run against megatron-core 0.19.2, which needs Python >= 3.12, in a second
# venv. On Python 3.12 the registry's torch==2.13.0 is a CUDA build; it runs on the CPU but imports only with the
# CUDA libraries it links: those wheels alone (--no-deps), not cuda-toolkit/cuda-bindings/cusolver/cupti/nvtx/cudart.
MEGATRON_VENV="${LOSSPARITY_MEGATRON_VENV:-.venv-megatron}"
MEGATRON_TESTS=(  # the representative subset run in it (the full matrix: scripts/megatron_matrix.sh)
  tests/integrations/test_integration_megatron.py
  tests/integrations/test_integration_megatron_moe.py
  tests/integrations/test_integration_megatron_ragged_cp.py
  tests/integrations/test_integration_megatron_schedules.py
  tests/integrations/test_integration_megatron_scopes.py
  # the oracle tests: lossparity's formulas against this release's own functions
  tests/test_megatron_oracle.py
  tests/integrations/test_megatron_cp_coefficients.py
  tests/test_moe_toolkit.py::test_routing_and_gates_match_megatron
  tests/test_moe_toolkit.py::test_seq_load_balancing_loss_matches_megatron_sb
  tests/test_moe_toolkit.py::test_global_running_matches_megatron_over_microbatches
  tests/test_docs.py::test_moe_worked_example_matches_megatron
  # MoEAccounting's megatron_quirks against this release's router and metrics tracker (the file's other
  # tests check lossparity against its naive float64 reference only: nothing release-specific)
  tests/test_moe_accounting.py::test_megatron_quirks_match_megatron_single_rank
  tests/test_moe_accounting.py::test_megatron_per_token_loss_deferred_equals_precount
  tests/test_moe_accounting.py::test_megatron_repeated_mtp_layer
  tests/test_moe_accounting.py::test_gloo_megatron_global_aux_gradient_is_one_over_d_of_its_log
  # the tracker's log arithmetic against this release's metrics tracker (MoEMetricsTracker on 0.19.2)
  tests/test_moe_mindformers.py::test_tracker_log_value_matches_megatron_track_moe_metrics
)

find_python() {  # $1 = X.Y: prints a Python X.Y interpreter (PYTHONXY, pythonX.Y on PATH, or pyenv's), or nothing
  local want="$1" c v var="PYTHON${1//./}"
  for c in "${!var:-}" "python$want"; do
    if [ -n "$c" ] && "$c" -c "import sys; assert '%d.%d' % sys.version_info[:2] == '$want'" >/dev/null 2>&1; then
      echo "$c"
      return 0
    fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    v="$(pyenv versions --bare 2>/dev/null | grep -E "^${want//./\\.}(\\.|\$)" | tail -1)"
    [ -n "$v" ] && [ -x "$(pyenv root)/versions/$v/bin/python$want" ] && echo "$(pyenv root)/versions/$v/bin/python$want"
  fi
  return 0
}
find_python312() { find_python 3.12; }

ensure_megatron_env() {  # the Python 3.12 venv with megatron-core 0.19.2; returns 1 when no Python 3.12 exists
  local py stamp pip
  stamp="$MEGATRON_VENV/.lossparity-megatron-$( (cat pyproject.toml; declare -f ensure_megatron_env) | sha1sum | cut -c1-12)"
  [ -f "$stamp" ] && return 0
  py="$(find_python312)"
  [ -n "$py" ] || return 1
  # (called in an `if`, where set -e does not apply: each step returns on failure itself)
  [ -x "$MEGATRON_VENV/bin/python" ] || "$py" -m venv "$MEGATRON_VENV" || return 1
  pip="$MEGATRON_VENV/bin/pip"
  "$pip" install -q --no-deps "torch==2.13.0" "triton==3.7.1" \
    "nvidia-cudnn-cu13==9.20.0.48" "nvidia-cusparselt-cu13==0.8.1" "nvidia-nccl-cu13==2.29.7" \
    "nvidia-nvshmem-cu13==3.4.5" "nvidia-cublas==13.1.1.3" "nvidia-cuda-nvrtc==13.0.88" "nvidia-cufft==12.0.0.61" \
    "nvidia-cufile==1.15.1.6" "nvidia-curand==10.4.0.35" "nvidia-cusparse==12.6.3.3" "nvidia-nvjitlink==13.5.37" \
    "megatron-core==0.19.2" || return 1
  # torch's and megatron-core's pure-Python imports (setuptools: torch.utils.cpp_extension), and pytest
  "$pip" install -q filelock "typing-extensions>=4.10.0" "sympy>=1.13.3" "networkx>=2.5.1" jinja2 "fsspec>=0.8.5" \
    "setuptools>=77.0.3" numpy "packaging>=24.2" pytest || return 1
  "$pip" install -q --no-deps -e . || return 1
  touch "$stamp"
}

megatron_tests() {  # the Megatron subset against megatron-core 0.19.2 (a second pytest run)
  if ! ensure_megatron_env; then
    echo "megatron-core 0.19.2 tests: no venv (no Python 3.12 interpreter: set PYTHON312; or a step above failed)" >&2
    return 1
  fi
  "$MEGATRON_VENV/bin/python" -m pytest -q -p no:cacheprovider "${MEGATRON_TESTS[@]}" "$@"
}

MAXTEXT_VENV="${LOSSPARITY_MAXTEXT_VENV:-.venv-maxtext}"
ensure_maxtext_env() {  # Python 3.12 venv with MaxText 0.2.5 on CPU and lossparity without torch (tests/maxtext)
  if [ ! -x "$MAXTEXT_VENV/bin/python" ]; then
    local py
    py="$(find_python312)"
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
    "$MAXTEXT_VENV/bin/python" -m pytest -q -p no:cacheprovider tests/maxtext "$@"
}

MINDFORMERS_VENV="${LOSSPARITY_MINDFORMERS_VENV:-.venv-mindspore}"
ensure_mindformers_env() {  # Python 3.11 venv: MindSpore 2.10.0 + MindFormers 2.0.0 on CPU, lossparity without torch
  if [ ! -x "$MINDFORMERS_VENV/bin/python" ]; then
    local py
    py="$(find_python 3.11)"
    [ -n "$py" ] || { echo "dev.sh: MindSpore 2.10.0 (cp311 wheel) needs Python 3.11 (set PYTHON311)" >&2; exit 2; }
    "$py" -m venv "$MINDFORMERS_VENV"
  fi
  local stamp="$MINDFORMERS_VENV/.lossparity-mindformers-$(cat requirements/mindformers-cpu.txt pyproject.toml | sha1sum | cut -c1-12)"
  [ -f "$stamp" ] && return 0
  # pinned closure, --no-deps: MindFormers 2.0.0 requires hyper-parallel (no registry here serves it; the tests
  # put an import stub on the path) and pins numpy<2 with pyarrow>=23, which cannot both hold
  "$MINDFORMERS_VENV/bin/pip" install -q --no-deps -r requirements/mindformers-cpu.txt
  "$MINDFORMERS_VENV/bin/pip" install -q --no-deps -e .  # lossparity.mindspore / lossparity.mindformers import no torch
  touch "$stamp"
}

mindformers_tests() {  # the MindFormers tests, for real, in the MindSpore venv (the main run skips tests/mindformers);
  # the torch references they compare against run in the main venv (LOSSPARITY_TORCH_PYTHON)
  ensure_mindformers_env
  LOSSPARITY_REQUIRE_MINDFORMERS=1 LOSSPARITY_TORCH_PYTHON="$VENV/bin/python" GLOG_v=3 \
    "$MINDFORMERS_VENV/bin/python" -m pytest -q -p no:cacheprovider tests/mindformers "$@"
}

# The test processes of the main part (pytest-xdist workers; 0: in pytest's own process). Run one after another,
# the suite keeps about 0.8 of the two cores busy (rank start-up, gloo waits, checkpoint writes); two workers
# fill them. --dist loadfile keeps each file on one worker (the module-scoped fixtures run once).
WORKERS="${LOSSPARITY_TEST_WORKERS:-2}"

main_tests() {  # the main suite in ./.venv (Python 3.11 or the default python3; the arguments: pytest's)
  "$VENV/bin/python" -m pytest -q -n "$WORKERS" --dist loadfile "$@"
}

lint_tests() {  # the static checks, as the first part of `./dev.sh test`
  lint
}

# The parts of `./dev.sh test`, one per environment, in order: part NAME runs the function NAME_tests. Every
# part runs even when one before it failed; each pytest part writes its counts to $LOSSPARITY_TEST_SUMMARY
# (tests/_ci_skips.py) and the command ends with one line per part, exiting 1 when any part failed. Another
# environment: define its NAME_tests function above and add NAME here.
read -r -a TEST_PARTS <<<"${LOSSPARITY_TEST_PARTS:-lint main megatron maxtext mindformers rl}"  # overridable: LOSSPARITY_TEST_PARTS="main maxtext"

summary_line() {  # $1 part, $2 exit status, $3 seconds, $4 the part's counts file (JSON, absent: no pytest summary)
  "$PY" - "$@" <<'PYEOF'
import json, os, sys
part, rc, secs, path = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
status = "passed" if rc == 0 else "FAILED"
if os.path.exists(path):
    c = json.load(open(path))
    counts = f"{c['ran']} ran, {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped"
elif part == "lint":
    counts = "ruff, ruff format, mypy, lint-imports, check_sizes"
else:
    counts = "no test counts (pytest did not finish)"
print(f"{part:>10}: {status} (exit {rc}, {secs} s): {counts}")
PYEOF
}

# The side environments (megatron, maxtext, mindformers, rl) are mostly downloads and unpacking, waiting on the
# network and the disk: run_parts builds them in the background while the static checks and the main suite run,
# and waits for a part's own build just before that part (a background job can only be waited for by this shell,
# not by the part's subshell). The part then calls its ensure_<name>_env itself: a no-op after a build that
# succeeded; after one that failed, the failure's output is printed and the build runs again in the foreground.
declare -A PREFETCH_PID=()
PREFETCH_DIR=""
prefetch_envs() {  # $@: part names; ensure_<name>_env of each part that has one, in the background
  local part
  PREFETCH_DIR="$(mktemp -d "${TMPDIR:-/tmp}/lossparity-envs-XXXXXX")"
  for part in "$@"; do
    declare -F "ensure_${part}_env" >/dev/null || continue
    ("ensure_${part}_env" >"$PREFETCH_DIR/$part.log" 2>&1) &
    PREFETCH_PID[$part]=$!
  done
}

await_env() {  # $1: a part name; waits for its background build, if any
  local pid="${PREFETCH_PID[$1]:-}"
  [ -n "$pid" ] || return 0
  if ! wait "$pid"; then
    echo "dev.sh: the background build of the $1 environment failed; its output:" >&2
    cat "$PREFETCH_DIR/$1.log" >&2
  fi
  unset "PREFETCH_PID[$1]"
}

run_parts() {  # runs the parts named (each with the pytest arguments PART_ARGS), then the summary
  local part rc start counts lines=() failed=0
  local -a names=("$@")
  prefetch_envs "${names[@]}"
  for part in "${names[@]}"; do
    counts="$(mktemp -u "${TMPDIR:-/tmp}/lossparity-$part-XXXXXX.json")"
    start=$SECONDS
    echo "== ./dev.sh test: $part" >&2
    set +e  # a failing part must not stop the others: run it in a subshell that keeps its own set -e
    await_env "$part"
    (set -e; LOSSPARITY_TEST_SUMMARY="$counts" "${part}_tests" "${PART_ARGS[@]}")
    rc=$?
    set -e
    lines+=("$(summary_line "$part" "$rc" "$((SECONDS - start))" "$counts")")
    rm -f "$counts"
    [ "$rc" -eq 0 ] || failed=1
  done
  echo "== ./dev.sh test: summary (CI=${CI:-})"
  printf '%s\n' "${lines[@]}"
  return "$failed"
}

# verl and OpenRLHF loss functions (tests/rl_frameworks): their releases with --no-deps into a side folder,
# imported with the main venv's torch and transformers; ray, tensordict and friends only as far as verl's
# core_algos imports them (tests/rl_frameworks/_frameworks.py skips the packages' heavy __init__ files).
RL_SITE="${LOSSPARITY_RL_SITE:-.venv-rl}"
RL_PACKAGES=(verl==0.9.1 openrlhf==0.11.2 omegaconf==2.4.0 antlr4-python3-runtime==4.9.3 tensordict==0.15.3
  pyvers==0.2.3 cloudpickle==3.1.3 codetiming==1.4.0 orjson==3.13.0 ray==2.60.0 msgpack==1.2.4 jsonschema==4.26.0
  jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 attrs==26.1.0)
ensure_rl_env() {
  local stamp="$RL_SITE/.lossparity-rl-$(echo "${RL_PACKAGES[*]}" | sha1sum | cut -c1-12)"
  [ -f "$stamp" ] && return 0
  "$VENV/bin/pip" install -q --no-deps --target "$RL_SITE/site" "${RL_PACKAGES[@]}"
  "$VENV/bin/pip" install -q --no-deps --target "$RL_SITE/verl071" verl==0.7.1  # the legacy workers' agg_loss
  touch "$stamp"
}

rl_tests() {  # verl's and OpenRLHF's loss functions against the presets (a separate pytest run)
  ensure_rl_env
  LOSSPARITY_RL_SITE="$RL_SITE" LOSSPARITY_REQUIRE_RL=1 "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
    tests/rl_frameworks
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
    elif [ "$#" -eq 0 ]; then  # the whole suite: every part, each environment (TEST_PARTS)
      PART_ARGS=()
      run_parts "${TEST_PARTS[@]}"
    else  # pytest arguments: the static checks and the main environment with them
      PART_ARGS=("$@")
      run_parts lint main
    fi
    ;;
  test-megatron)
    megatron_tests
    ;;
  test-maxtext)
    maxtext_tests
    ;;
  test-mindformers)
    ensure_env test  # the torch references of tests/mindformers run in the main venv
    mindformers_tests "$@"
    ;;
  *)
    echo "usage: ./dev.sh main|test|test-megatron|test-maxtext|test-mindformers|lint|wheel|docs [args...]" >&2
    exit 2
    ;;
esac
