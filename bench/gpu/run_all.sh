#!/usr/bin/env bash
# The GPU runbook: everything meshtrain measures on real NVIDIA GPUs, one command, one JSON per part.
#
#   bench/gpu/run_all.sh OUT_DIR
#
# 1. env.json           the GPUs (nvidia-smi), JAX and its devices
# 2. kernel_tests.json  the Pallas kernel tests with the kernels compiled by Triton (not interpreted)
#                       against their references, float32 and bf16 (bench/gpu/kernel_tests.py)
# 3. mfu.json           single-GPU MFU of a ~1B Llama, bf16 and FP8, kernels off and on (bench/gpu/mfu.py)
# 4. overlap.json       the step compiled over all local GPUs: asynchronous collectives and the compute
#                       scheduled beside them (bench/gpu/overlap.py)
#
# Install: where JAX already sees the GPU (a machine set up with its own JAX for CUDA) that JAX is
# kept and meshtrain runs from this checkout without its pins; its other needs come from the package
# index, or from a folder of wheels on machines without one (WHEELS=/path/to/wheels, made by
# bench/gpu/offline_wheels.sh: installed with --no-deps into SITE, default /tmp/meshtrain-site).
# Where JAX does not see the GPU, the `gpu` extra is installed (pip install -e '.[gpu]'). On a
# machine without an NVIDIA GPU it stops at once. Each part has its own time limit (180 + 300 + 90 s),
# so the parts end within 10 minutes; a part over its limit is recorded as such and the next runs.
set -uo pipefail
OUT=${1:?usage: bench/gpu/run_all.sh OUT_DIR}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PYTHON:-python3}

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "run_all.sh: no NVIDIA GPU here (nvidia-smi finds none); the runbook needs one" >&2
  exit 2
fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$ROOT"
start=$(date +%s)
log() { echo "[run_all $(( $(date +%s) - start ))s] $*"; }

# ---- install ------------------------------------------------------------------------------------
if [ -n "${WHEELS:-}" ]; then
  SITE=${SITE:-/tmp/meshtrain-site}
  log "installing the wheels in $WHEELS into $SITE (no index, no dependencies)"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$WHEELS"/*.whl || exit 1
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if "$PY" -c "import jax, sys; sys.exit(0 if any(d.platform == 'gpu' for d in jax.devices()) else 1)" 2>/dev/null; then
  log "JAX $("$PY" -c 'import jax; print(jax.__version__)') sees the GPU: kept"
  if ! "$PY" -c "import meshtrain.train" 2>/dev/null; then  # only what is missing, never JAX
    needs=$("$PY" - <<'EOF'
import ast, importlib.util, pathlib, sys
MODULES = {"ml-collections": "ml_collections", "tensorflow-datasets": "tensorflow_datasets", "array-record": "array_record",
           "orbax-checkpoint": "orbax.checkpoint", "absl-py": "absl", "tensorboardX": "tensorboardX"}
tree = ast.parse(pathlib.Path("setup.py").read_text())
for node in ast.walk(tree):
    if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "INSTALL_REQUIRES":
        reqs = [ast.literal_eval(e) for e in node.value.elts]
def applies(req):  # setup.py's only markers: python_version < / >= "3.12"
    if ";" not in req:
        return True
    _, op, version = req.split(";", 1)[1].split()
    wanted = tuple(int(x) for x in version.strip('"').split("."))
    return sys.version_info[:2] < wanted if op == "<" else sys.version_info[:2] >= wanted
reqs = [r.split(";")[0].strip() for r in reqs if applies(r)]
def missing(req):
    name = req.replace(">", "=").split("=")[0]
    module = MODULES.get(name, name)
    try:
        return importlib.util.find_spec(module) is None
    except ModuleNotFoundError:
        return True
print(" ".join(r for r in reqs if missing(r)))
EOF
)
    log "installing meshtrain's other needs: $needs"
    "$PY" -m pip install -q $needs || { echo "run_all.sh: could not install $needs (no package index? pass WHEELS=dir)" >&2; exit 1; }
  fi
else
  log "JAX does not see the GPU: installing the gpu extra"
  "$PY" -m pip install -q -e '.[gpu]' || { echo "run_all.sh: pip install -e '.[gpu]' failed" >&2; exit 1; }
fi

# ---- parts --------------------------------------------------------------------------------------
status=0
part() {  # part NAME SECONDS COMMAND...: runs one part under its time limit, keeps going on failure
  local name=$1 limit=$2; shift 2
  log "$name (limit ${limit}s)"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 12 "$OUT/$name.log"
  if [ $rc -ne 0 ]; then
    status=1
    [ -s "$OUT/$name.json" ] || printf '{"bench": "%s", "error": "exit %d (124: over its %ss limit); see %s.log"}\n' \
      "$name" "$rc" "$limit" "$name" >"$OUT/$name.json"
  fi
}

"$PY" - >"$OUT/env.json" <<'EOF'
import json, subprocess, jax
smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
                      "--format=csv,noheader"], capture_output=True, text=True).stdout.strip().splitlines()
print(json.dumps({"bench": "gpu_env", "jax": jax.__version__, "devices": [d.device_kind for d in jax.devices()],
                  "nvidia_smi": smi}))
EOF
cat "$OUT/env.json"
part kernel_tests 180 "$PY" bench/gpu/kernel_tests.py --out "$OUT/kernel_tests.json"
part mfu 300 "$PY" bench/gpu/mfu.py --out "$OUT/mfu.json"
part overlap 90 "$PY" bench/gpu/overlap.py --out "$OUT/overlap.json"
log "done: $(ls "$OUT"/*.json | wc -l) JSON files in $OUT"
exit $status
