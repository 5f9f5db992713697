#!/usr/bin/env bash
# The GPU session in one command: install what the GPU machine lacks, run the GPU suite
# and the GPU bench, and keep every log and result.
#
#   bench/gpu_session.sh suite      # python -m pytest tests/gpu -q -rs -n 8 (100 s on an H200)
#   bench/gpu_session.sh bench      # python bench/gpu.py: sections 1, 3, 4 (about 5 min)
#   bench/gpu_session.sh capacity   # python bench/gpu.py --sections 2      (5 to 10 min)
#   bench/gpu_session.sh quick      # the suite (MYELIN_GPU_SUITE_S, 400 s), then gpu.py --quick
#   bench/gpu_session.sh            # suite, then bench, inside one 10-minute budget
#
# Seen on one H200 (2026-11-28): the suite in 100 s with 8 workers, `quick` in 475 s. The
# other times are estimates. Where one command may run at most 10 minutes, run suite,
# bench and capacity as separate commands.
#
# The GPU machine has torch, msgpack, nvidia-ml-py, pytest and pytest-timeout but not
# pyzmq and cannot reach a package index: wheels in .whl/ (gitignored; the README's
# "GPU suite" says how to fetch them) are installed into /tmp/myelin-site, and the
# checkout itself goes on PYTHONPATH (the test workers and bench workers import myelin).
#
# Logs and results go to $OUT when it is set (the device tool brings $OUT back), else to
# runs/gpu-session/: env.txt, nvidia-smi.txt, gpu-suite.log, gpu-suite.xml,
# gpu-bench.log, gpu-capacity.log, gpu.json (also written to bench/results/gpu.json,
# merged by section with what is there). Exit status: the first step that failed (pytest's
# or the bench's), 3 if the environment is not usable or has no CUDA, 124 if a step ran
# out of time. MYELIN_GPU_DRY_RUN=1 runs it on a CPU machine (everything skips).

set -uo pipefail
cd "$(dirname "$0")/.." || exit 3
ROOT=$PWD
DEST=${OUT:-$ROOT/runs/gpu-session}
mkdir -p "$DEST"
PY=${PYTHON:-python3}
BUDGET_S=${MYELIN_GPU_BUDGET_S:-570}  # the whole script, for the default (suite + bench)
START=$(date +%s)
export PYTHONUNBUFFERED=1

say() { echo "[gpu_session $(date +%H:%M:%S)] $*"; }
left() { echo $((BUDGET_S - ($(date +%s) - START))); }

# -- 1. what the machine lacks ---------------------------------------------------------------
if ! "$PY" -c "import zmq" 2>/dev/null; then
  if compgen -G ".whl/*.whl" >/dev/null; then
    say "installing $(ls .whl/*.whl | xargs -n1 basename | tr '\n' ' ')into /tmp/myelin-site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/myelin-site .whl/*.whl || exit 3
    export PYTHONPATH=/tmp/myelin-site${PYTHONPATH:+:$PYTHONPATH}
  else
    say "pyzmq is missing and .whl/ holds no wheel: fetch it as the README's 'GPU suite' says"
    exit 3
  fi
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}

# -- 2. what the machine is --------------------------------------------------------------------
nvidia-smi >"$DEST/nvidia-smi.txt" 2>&1 || true
"$PY" - >"$DEST/env.txt" 2>&1 <<'EOF'
import platform, sys
import msgpack, torch, zmq
import myelin
print("python", sys.version.split()[0], platform.platform())
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
print("gpus", torch.cuda.device_count(),
      [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
print("pyzmq", zmq.__version__, "libzmq", zmq.zmq_version(), "msgpack", msgpack.version)
print("myelin", myelin.__version__, myelin.__file__)
try:
    import pynvml
    pynvml.nvmlInit()
    print("nvml driver", pynvml.nvmlSystemGetDriverVersion())
except Exception as exc:
    print("nvml", exc)
EOF
status=$?
cat "$DEST/env.txt"
if [ $status -ne 0 ]; then say "the environment is not usable (see env.txt)"; exit 3; fi
if ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  say "CUDA is not available here: everything would skip"
  # MYELIN_GPU_DRY_RUN=1 goes on anyway, to check the script itself on a CPU machine
  if [ "${MYELIN_GPU_DRY_RUN:-0}" != 1 ]; then exit 3; fi
fi

# -- 3. the steps --------------------------------------------------------------------------------
first_failure=0
record() { if [ "$1" -ne 0 ] && [ $first_failure -eq 0 ]; then first_failure=$1; fi; }

suite() {  # $1: seconds it may take
  # pytest-xdist where the machine has it: 8 workers ran the suite in 100 s on an H200, and
  # a test that breaks its CUDA context (a device-side assert is sticky) takes only its
  # own worker down, not every test after it
  local workers=()
  if "$PY" -c "import xdist" 2>/dev/null; then workers=(-n "${MYELIN_GPU_WORKERS:-8}"); fi
  say "GPU suite: python -m pytest tests/gpu -q -rs ${workers[*]} (limit $1 s)"
  timeout --signal=INT --kill-after=20 "$1" "$PY" -m pytest tests/gpu -q -rfEs --durations=20 \
    "${workers[@]}" -p no:cacheprovider --junitxml "$DEST/gpu-suite.xml" 2>&1 | tee "$DEST/gpu-suite.log"
  record "${PIPESTATUS[0]}"
}

bench() {  # $1: seconds it may take; $2: log name; the rest: bench/gpu.py's arguments
  local limit=$1 log=$2
  shift 2
  if [ "$limit" -lt 60 ]; then
    say "GPU bench skipped: ${limit} s left of the budget; run 'bench/gpu_session.sh bench' apart"
    record 124
    return
  fi
  say "GPU bench: python bench/gpu.py $* (limit $limit s)"
  timeout --signal=INT --kill-after=20 "$limit" "$PY" bench/gpu.py --timeout 300 "$@" 2>&1 \
    | tee "$DEST/$log"
  record "${PIPESTATUS[0]}"
  if [ -f bench/results/gpu.json ]; then cp bench/results/gpu.json "$DEST/gpu.json"; fi
}

case "${1:-all}" in
  suite) suite 570 ;;
  bench) bench 570 gpu-bench.log ;;
  capacity) bench 570 gpu-capacity.log --sections 2 ;;
  quick)
    suite "${MYELIN_GPU_SUITE_S:-400}"
    bench "$(left)" gpu-bench.log --quick --sections 1,2,3,4
    ;;
  all)
    suite 200
    bench "$(left)" gpu-bench.log
    ;;
  *)
    echo "usage: bench/gpu_session.sh [suite|bench|capacity|quick|all]" >&2
    exit 2
    ;;
esac
say "done in $(($(date +%s) - START)) s; logs and results in $DEST (exit $first_failure)"
exit $first_failure
