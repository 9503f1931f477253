#!/usr/bin/env bash
# The GPU runbook: everything meshtrain measures on real NVIDIA GPUs, one command, one JSON per part.
#
#   bench/gpu/run_all.sh OUT_DIR
#
# 1. env.json           the GPUs (nvidia-smi), JAX and its devices
# 2. kernel_tests.json  the Pallas kernel tests with the kernels compiled by Triton (not interpreted)
#                       against their references, float32 and bf16 (bench/gpu/kernel_tests.py); pytest's
#                       verbose log streamed to kernel_tests.pytest.log (a part stopped at its limit
#                       reports the tests that finished)
# 3. mfu.json           single-GPU MFU of a ~1B Llama, bf16 and FP8, kernels off and on, with each variant's
#                       top GPU operations from a two-step profile (bench/gpu/mfu.py --profile)
# 4. kernels.json       flash attention against XLA's and cuDNN's at the mfu model's shape and at 8k and 16k
#                       tokens, forward and forward + backward, TFLOP/s and % of peak (bench/kernels.py)
# 5. pipeline_branches.json  one pipeline stage's branches timed on the GPU beside the cost model's roofline,
#                       and each schedule's modeled step from the measured times (bench/gpu/pipeline_branches.py)
# 6. overlap.json       the step compiled over all local GPUs: asynchronous collectives and the compute
#                       scheduled beside them (bench/gpu/overlap.py)
# 7. moe_step.json     the MoE's grouped matmul kernels at Qwen3-30B-A3B's and Mixtral's expert shapes (TFLOP/s,
#                       share of the peak: the figures `plan.hlo.GROUPED_EFFICIENCY` assumes until measured) and
#                       a Qwen3-shaped MoE step, measured beside the kernel model (bench/gpu/moe_step.py)
# 8. flash_sweep.json   only when RUNBOOK_PARTS names it: the flash kernel's tile sizes, warps and pipeline
#                       stages timed at the mfu model's shape (bench/kernels.py --sweep)
#
# Install (bench/gpu/install.sh): a JAX already installed in setup.py's range is kept, never replaced
# (out of range: the runbook stops); meshtrain goes in with --no-deps, and its other needs come from the
# package index or, on machines without one, from a folder of wheels (WHEELS=DIR, filled where an index
# is reachable by bench/gpu/offline_wheels.sh DIR). With no JAX at all it installs the `gpu` extra. On a
# machine without an NVIDIA GPU it stops at once. Each part has its own time limit (240, 300, 120, 120, 60, 90 s),
# cut to what is left of RUNBOOK_SECONDS (default 600) from the runbook's start, so that the runbook
# ends within it; a part over its limit is recorded as such and the next runs (none starts with under
# 20 s left). RUNBOOK_PARTS (comma-separated part names; default parts 1-7) runs a subset, in the order
# above; MFU_VARIANTS (comma-separated, bench/gpu/mfu.py's --variants) times only those variants.
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
PYTHON="$PY" bash bench/gpu/install.sh || exit 1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # the parts import tests/ beside meshtrain
if ! "$PY" -c "import jax, sys; sys.exit(0 if any(d.platform == 'gpu' for d in jax.devices()) else 1)" 2>/dev/null; then
  echo "run_all.sh: JAX $("$PY" -c 'import jax; print(jax.__version__)') does not see the GPU (no CUDA plugin?" \
       "it is kept: add the plugin of its version, e.g. pip install 'jax[cuda12]==<that version>')" >&2
  exit 1
fi

# ---- parts --------------------------------------------------------------------------------------
status=0
budget=${RUNBOOK_SECONDS:-600}
part() {  # part NAME SECONDS COMMAND...: runs one part under its time limit, keeps going on failure
  local name=$1 limit=$2; shift 2
  local wanted=${RUNBOOK_PARTS:-kernel_tests,mfu,kernels,pipeline_branches,overlap,moe_step}
  if [[ ",$wanted," != *",$name,"* ]]; then
    log "$name: not in RUNBOOK_PARTS=$wanted"
    return
  fi
  local left=$(( budget - ($(date +%s) - start) - 5 ))
  if [ "$left" -lt 20 ]; then
    log "$name: skipped (${left}s left of RUNBOOK_SECONDS=$budget)"
    printf '{"bench": "%s", "error": "skipped: %ss left of the runbook'"'"'s %ss"}\n' "$name" "$left" "$budget" \
      >"$OUT/$name.json"
    status=1
    return
  fi
  [ "$left" -lt "$limit" ] && limit=$left
  rm -f "$OUT/$name.json"  # parts write their JSON as they go: none from an earlier run may stand for this one's
  log "$name (limit ${limit}s)"
  RUNBOOK_PART_SECONDS=$limit timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
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
part kernel_tests 240 "$PY" bench/gpu/kernel_tests.py --out "$OUT/kernel_tests.json" --log "$OUT/kernel_tests.pytest.log"
part mfu 300 "$PY" bench/gpu/mfu.py --out "$OUT/mfu.json" --profile "${TMPDIR:-/tmp}/meshtrain_mfu_profile" \
  ${MFU_VARIANTS:+--variants "$MFU_VARIANTS"}
part kernels 120 "$PY" bench/kernels.py --lengths 8192,16384 --iters 5 --out "$OUT/kernels.json"
part pipeline_branches 120 "$PY" bench/gpu/pipeline_branches.py --out "$OUT/pipeline_branches.json"
part overlap 60 "$PY" bench/gpu/overlap.py --out "$OUT/overlap.json"
part moe_step 90 "$PY" bench/gpu/moe_step.py --out "$OUT/moe_step.json"
part flash_sweep 150 "$PY" bench/kernels.py --sweep --out "$OUT/flash_sweep.json"
log "done: $(ls "$OUT"/*.json | wc -l) JSON files in $OUT"
exit $status
