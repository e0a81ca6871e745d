#!/usr/bin/env bash
# The one-GPU device run, in one call: the GPU tests, then the end-to-end, Dispatch, Mods and
# GEMM benchmarks, each under its own time limit so that one slow part cannot eat the rest.
# Usage on the device machine, from the repo root (carry .device; .whl for torchao):
#   source .device/activate.sh && bash bench/device_h100.sh "$OUT" [PART...]
# PARTS: tests e2e dispatch mods gemm (default: tests e2e, which fill one 600 s call; run
# dispatch mods gemm in a second call).
set -u
out=$1
shift
parts=${*:-tests e2e}
has() { [[ " $parts " == *" $1 "* ]]; }
mkdir -p "$out" /tmp/h100
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpus.txt"
if has tests; then
  (timeout 150 python -m pytest tests/gpu -m "not multigpu" -q -p no:cacheprovider -x; echo "rc=$?") \
      > "$out/gpu_tests.txt" 2>&1
fi
if has e2e; then
  (timeout 400 python bench/e2e.py --configs wukong,dcn,dlrm --out /tmp/h100/e2e; echo "rc=$?") > /tmp/h100/e2e.txt 2>&1
fi
if has dispatch; then
  (timeout 200 python bench/dispatch.py --iters 20 --out /tmp/h100/dispatch; echo "rc=$?") \
      > /tmp/h100/dispatch.txt 2>&1
fi
if has mods; then
  (timeout 150 python bench/mods.py --out /tmp/h100/mods; echo "rc=$?") > /tmp/h100/mods.txt 2>&1
fi
if has gemm; then
  (timeout 200 python bench/gemm.py --out /tmp/h100/gemm; echo "rc=$?") > /tmp/h100/gemm.txt 2>&1
fi
tar czf "$out/h100.tgz" -C /tmp h100
