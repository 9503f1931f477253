#!/usr/bin/env bash
# Wheels for running the GPU runbook on a machine that has JAX for CUDA but no package index.
#
#   bench/gpu/offline_wheels.sh DIR [PYTHON_VERSION]     (default 3.12; run where PyPI is reachable)
#   ... copy DIR to the GPU machine, then there:
#   WHEELS=DIR bash bench/gpu/run_all.sh OUT_DIR
#
# The machine is expected to hold JAX and what GPU images carry beside it (flax, optax, orbax-checkpoint,
# chex, numpy, absl-py, etils, protobuf, pyarrow, psutil, requests, tqdm, wrapt, PyYAML, cloudpickle,
# packaging, matplotlib). The folder holds meshtrain's other needs and theirs, pinned where setup.py pins
# them, each without its dependencies (all listed here), plus six and attrs, which some images lack:
# bench/gpu/install.sh installs only the wheels whose project is missing. tests/test_offline_install.py
# builds this path on CPU.
set -euo pipefail
DIR=${1:?usage: bench/gpu/offline_wheels.sh DIR [PYTHON_VERSION]}
PYV=${2:-3.12}
mkdir -p "$DIR"
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
for pkg in ml-collections==1.1.0 grain==0.2.18 array-record==0.8.6 tensorflow-datasets==4.9.10 tensorboardX==2.6.5 \
           portpicker dm-tree immutabledict simple-parsing docstring-parser tensorflow-metadata \
           googleapis-common-protos termcolor toml six attrs; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
    "${platforms[@]}" -d "$DIR" "$pkg"
done
python3 -m pip wheel -q --no-deps -w "$DIR" promise  # tensorflow-datasets' need, published as a source archive only
ls "$DIR"
