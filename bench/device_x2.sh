#!/usr/bin/env bash
# The 2 x H200 device run, in one call (device time is scarce): the multi-GPU integration tests,
# the embedding-comm benchmark on both GPUs, the Dispatch benchmark and the Probe-overhead
# benchmark. Usage on the device machine, from the repo root:
#   source .device/activate.sh && bash bench/device_x2.sh "$OUT" [PART...]
# PARTS: multigpu comm dispatch probe (default: all; dispatch and probe run side by side, one per GPU);
# fp8_pays: bench.e2e LoKA against bf16 + compile + graphs, one config list per GPU, side by side
# (E2E_GPU0, E2E_GPU1: config lists; E2E_T0, E2E_T1: seconds per run; E2E_BATCHES; each run its own
# process and folder); scaling: bench.scaling, weak scaling of DLRM and Wukong on 1 and 2 GPUs
# (both GPUs, before the side-by-side parts; the default run, 12 torchrun jobs, cut at 240 s).
# $OUT returns at most 8 files: everything goes into x2.tgz, rewritten after every part, so a
# call killed by its time limit still returns the parts it finished.
set -u
out=$1
shift
parts=${*:-multigpu comm dispatch probe}
E2E_BATCHES=${E2E_BATCHES:-32768}
has() { [[ " $parts " == *" $1 "* ]]; }
w=/tmp/x2
rm -rf "$w" /tmp/mg  # a warm machine still holds the last call's files
mkdir -p "$out" "$w/single"
# Parts running side by side save through one lock.
save() { ( flock 9; tar czf "$out/x2.tgz.tmp" -C /tmp x2 && mv "$out/x2.tgz.tmp" "$out/x2.tgz" ) 9> /tmp/x2.lock; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpus.txt"
if has multigpu; then
  (timeout 260 python -m pytest -m multigpu tests/gpu/test_multigpu.py -q -s -p no:cacheprovider \
      --basetemp=/tmp/mg; echo "rc=$?") > "$w/multigpu.txt" 2>&1
  mkdir -p "$w/multigpu_reports"
  (cd /tmp/mg && tar cf - --exclude='*.pt' --exclude='checkpoints' .) 2>/dev/null | tar xf - -C "$w/multigpu_reports"
  save
fi
if has comm; then
  (timeout 130 python -m bench.comm --steps 60 --out "$w/comm"; echo "rc=$?") > "$w/comm.txt" 2>&1
  save
fi
if has scaling; then
  # SIGTERM from timeout: bench.scaling stops the running job's processes and keeps the jobs done.
  (timeout 240 python -m bench.scaling --out "$w/scaling"; echo "rc=$?") > "$w/scaling.txt" 2>&1
  save
fi
if has dispatch; then
  CUDA_VISIBLE_DEVICES=0 timeout 150 python -m bench.dispatch --iters 20 \
      --backends fbgemm_rowwise,torch_scaled_mm --out "$w/single/dispatch" > "$w/single/dispatch.txt" 2>&1 &
fi
if has probe; then
  CUDA_VISIBLE_DEVICES=1 timeout 150 python -m bench.probe_overhead --out "$w/single/probe.json" \
      > "$w/single/probe.txt" 2>&1 &
fi
if has fp8_pays; then
  # One GPU per config list; the ratios are within one process, so the neighbour does not bias them.
  fp8_pays() {  # GPU, configs, seconds per run
    for cfg in $2; do
      for b in $E2E_BATCHES; do
        (CUDA_VISIBLE_DEVICES=$1 timeout $3 python -m bench.e2e --configs $cfg --batches $b \
            --ne-steps 0 --steps 60 --profile-steps 5 --ledger \
            --profile-variants bf16+compile+graphs,loka_aggressive+compile+graphs \
            --variants bf16+compile+graphs,loka_aggressive+compile+graphs,loka_safe+compile+graphs \
            --out $w/fp8_pays_${cfg}_b$b; echo "rc=$?") > $w/fp8_pays_${cfg}_b$b.txt 2>&1
        save
      done
    done
  }
  fp8_pays 0 "${E2E_GPU0:-wukong}" ${E2E_T0:-540} &
  fp8_pays 1 "${E2E_GPU1:-dcn dlrm}" ${E2E_T1:-270} &
fi
wait
save
