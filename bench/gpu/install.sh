#!/usr/bin/env bash
# Installs this checkout into a Python that may already hold its own JAX (a GPU machine's build for
# CUDA 12 or 13), without ever replacing that JAX, with or without a package index.
#
#   [PYTHON=python3] [WHEELS=DIR] bash bench/gpu/install.sh
#
# - JAX installed and in setup.py's range: kept. Installed out of range: stops with one line (exit 3).
#   Not installed: the `gpu` extra is installed (from the index, or from WHEELS if it holds JAX).
# - meshtrain's other needs that this Python lacks: from WHEELS (a folder filled by
#   bench/gpu/offline_wheels.sh where an index is reachable), `pip install --no-index --no-deps` of the
#   wheels whose project is not installed, or else from the package index.
# - meshtrain itself: `pip install --no-deps -e .` (no build isolation, so no index is needed: the
#   environment's setuptools builds it).
# - Then every requirement is checked installed (bench/gpu/_needs.py check) and the data path imported.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PYTHON:-python3}
cd "$ROOT"
say() { echo "install: $*"; }
pip_install() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }

offline=()
[ -n "${WHEELS:-}" ] && offline=(--no-index --find-links "$WHEELS")
if [ -n "${WHEELS:-}" ] && ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  echo "install: WHEELS=$WHEELS holds no .whl files (fill it with bench/gpu/offline_wheels.sh DIR where an index is reachable)" >&2
  exit 1
fi

jax=$("$PY" bench/gpu/_needs.py jax) || { echo "install: $jax" >&2; exit 3; }
if [ "$jax" = missing ]; then
  say "no JAX in $("$PY" -c 'import sys; print(sys.executable)'): installing the gpu extra"
  pip_install "${offline[@]}" -e '.[gpu]' || { echo "install: pip install -e '.[gpu]' failed" >&2; exit 1; }
else
  say "JAX ${jax#kept } found in range: kept"
fi

if [ -n "${WHEELS:-}" ]; then
  wheels=$("$PY" bench/gpu/_needs.py wheels "$WHEELS")
  if [ -n "$wheels" ]; then
    say "from $WHEELS (no index): $(echo "$wheels" | xargs -n1 basename | sed 's/-[0-9].*//' | tr '\n' ' ')"
    # shellcheck disable=SC2086
    pip_install --no-index --no-deps --no-compile $wheels || { echo "install: installing the wheels in $WHEELS failed" >&2; exit 1; }
  fi
else
  missing=$("$PY" bench/gpu/_needs.py missing)
  if [ -n "$missing" ]; then
    say "from the package index: $(echo "$missing" | tr '\n' ' ')"
    # shellcheck disable=SC2086
    pip_install $missing || { echo "install: could not install $missing (no package index? pass WHEELS=DIR)" >&2; exit 1; }
  fi
fi

pip_install "${offline[@]}" --no-deps --no-build-isolation -e . \
  || { echo "install: pip install --no-deps -e . failed (it needs setuptools in this Python)" >&2; exit 1; }
"$PY" bench/gpu/_needs.py check || exit 1
"$PY" -c "import meshtrain.train, tensorflow_datasets, grain, array_record, ml_collections, tensorboardX" \
  || { echo "install: meshtrain's modules do not import (above: the module missing)" >&2; exit 1; }
say "meshtrain $("$PY" -c 'import jax; print(f"on jax {jax.__version__}, devices: {jax.devices()[0].platform} x {jax.device_count()}")')"
