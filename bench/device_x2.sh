#!/usr/bin/env bash
# The 2 x H200 device run, in one call (device time is scarce): the multi-GPU integration tests,
# the embedding-comm benchmark on both GPUs, the Dispatch benchmark and the Probe-overhead
# benchmark. Usage on the device machine, from the repo root:
#   source .device/activate.sh && bash bench/device_x2.sh "$OUT" [PART...]
# PARTS: multigpu comm dispatch probe (default: all; dispatch and probe run side by side, one per GPU).
set -u
out=$1
shift
parts=${*:-multigpu comm dispatch probe}
has() { [[ " $parts " == *" $1 "* ]]; }
mkdir -p "$out" /tmp/single
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpus.txt"
if has multigpu; then
  (timeout 260 python -m pytest -m multigpu tests/gpu/test_multigpu.py -q -s -p no:cacheprovider \
      --basetemp=/tmp/mg; echo "rc=$?") > "$out/multigpu.txt" 2>&1
  (cd /tmp/mg && tar czf "$out/multigpu_reports.tgz" --exclude='*.pt' --exclude='checkpoints' .) 2>/dev/null
fi
if has comm; then
  (timeout 130 python bench/comm.py --steps 60 --out /tmp/comm; echo "rc=$?") > "$out/comm.txt" 2>&1
  cp /tmp/comm/comm.md /tmp/comm/comm.json "$out/" 2>/dev/null
fi
if has dispatch; then
  CUDA_VISIBLE_DEVICES=0 timeout 150 python bench/dispatch.py --iters 30 --out /tmp/single/dispatch \
      > /tmp/single/dispatch.txt 2>&1 &
fi
if has probe; then
  CUDA_VISIBLE_DEVICES=1 timeout 150 python bench/probe_overhead.py --out /tmp/single/probe.json \
      > /tmp/single/probe.txt 2>&1 &
fi
wait
tar czf "$out/single.tgz" -C /tmp single
