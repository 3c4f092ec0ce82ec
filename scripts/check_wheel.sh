#!/usr/bin/env bash
# The package as users get it (./dev.sh wheel; CI runs it): build the sdist, and the wheel from it, check them
# (twine check, every file of src/lossparity in the wheel, the extras in its metadata), install the wheel
# into a fresh virtual environment (not editable: only its declared dependencies plus the CPU torch), and
# run `lossparity --version`, `lossparity modes` and the README quick start from it, outside the checkout.
# Usage: scripts/check_wheel.sh [DEV_VENV]   (DEV_VENV has build and twine: the `dev` extra; default .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
# Nothing of the checkout or the user's site may leak into the fresh environment (a PYTHONPATH naming src/
# would make pip think lossparity is installed already).
unset PYTHONPATH PYTHONHOME
export PYTHONNOUSERSITE=1
ROOT="$PWD"
DEV="${1:-.venv}"
DIST="$ROOT/dist"
FRESH="$ROOT/.venv-wheel"
start=$SECONDS
rm -rf "$DIST" "$FRESH"
log="$(mktemp)"
"$DEV/bin/python" -m build --outdir "$DIST" . >"$log" 2>&1 || { cat "$log"; exit 1; }
rm -f "$log"
"$DEV/bin/twine" check --strict "$DIST"/*
"$DEV/bin/python" - "$DIST" <<'PY'
import email, pathlib, subprocess, sys, zipfile

dist = pathlib.Path(sys.argv[1])
(whl,) = dist.glob("lossparity-*.whl")
names = set(zipfile.ZipFile(whl).namelist())
tracked = subprocess.run(["git", "ls-files", "src/lossparity"], capture_output=True, text=True, check=True).stdout
missing = [p for p in tracked.split() if p.removeprefix("src/") not in names]
assert not missing, f"{whl.name} lacks files of src/lossparity (package data?): {missing}"
meta = email.message_from_bytes(zipfile.ZipFile(whl).read(next(n for n in names if n.endswith(".dist-info/METADATA"))))
extras = set(meta.get_all("Provides-Extra") or [])
wanted = {"hf", "trl", "megatron", "torchtitan", "jax", "maxtext", "report", "docs"}
assert wanted <= extras, f"{whl.name}: extras missing from the metadata: {sorted(wanted - extras)}"
assert meta["Version"], "no version in the metadata"
print(f"{whl.name}: {whl.stat().st_size / 1024:.0f} KiB, {len(names)} files, extras {', '.join(sorted(extras))}")
PY
built=$SECONDS
"$DEV/bin/python" -m venv "$FRESH"  # on the interpreter behind DEV, without DEV's packages
# The CPU build first (a bare torch requirement would pull a CUDA build), then the wheel and its dependencies.
"$FRESH/bin/pip" install -q --no-compile "torch==2.13.0"
"$FRESH/bin/pip" install -q --no-compile "$DIST"/lossparity-*.whl
installed=$SECONDS
cd "$(mktemp -d)"  # not the checkout: `import lossparity` must find the installed wheel
"$FRESH/bin/lossparity" --version
"$FRESH/bin/lossparity" modes >modes.txt
head -n 3 modes.txt
"$FRESH/bin/python" "$ROOT/scripts/readme_quick_start.py" "$ROOT/README.md" | tee quick.txt
grep -q "$FRESH" quick.txt || { echo "the quick start did not run from the fresh environment" >&2; exit 1; }
echo "wheel: build and checks $((built - start)) s, fresh environment and install $((installed - built)) s," \
  "commands $((SECONDS - installed)) s"
