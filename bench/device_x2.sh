#!/usr/bin/env bash
# The 2 x H200 device run, in one call (device time is scarce): the multi-GPU integration tests,
# the embedding-comm benchmark on both GPUs, the Dispatch benchmark and the Probe-overhead
# benchmark. Usage on the device machine, from the repo root:
#   source .device/activate.sh && bash bench/device_x2.sh "$OUT" [PART...]
# PARTS: multigpu sparse2d comm dispatch probe (default: multigpu comm dispatch probe; dispatch and probe run side by side, one per GPU);
# fp8_pays: bench.e2e LoKA against bf16 + compile + graphs, one list of runs per GPU, side by side
# (E2E_GPU0, E2E_GPU1: runs as config:batch:seconds[:variants[:args]], args comma-separated
# like --repeats=3; E2E_VARIANTS; E2E_PROFILE: the
# profiled variants; E2E_EXTRA: more bench.e2e arguments, e.g. "--repeats 3"; E2E_PYPROFILE=1 adds
# a cProfile of the profiled steps; each run its own process, folder and half of the host's cores); scaling: bench.scaling, weak scaling on 1 and 2 GPUs
# (both GPUs, before the side-by-side parts; SCALING_ARGS, SCALING_TIMEOUT).
# $OUT returns at most 8 files: everything goes into x2.tgz, rewritten after every part, so a
# call killed by its time limit still returns the parts it finished.
set -u
out=$1
shift
parts=${*:-multigpu comm dispatch probe}
has() { [[ " $parts " == *" $1 "* ]]; }
w=/tmp/x2
rm -rf "$w" /tmp/mg /tmp/mg2d  # a warm machine still holds the last call's files
mkdir -p "$out" "$w/single"
# Parts running side by side save through one lock.
save() { ( flock 9; tar czf "$out/x2.tgz.tmp" -C /tmp x2 && mv "$out/x2.tgz.tmp" "$out/x2.tgz" ) 9> /tmp/x2.lock; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpus.txt"
if has multigpu; then
  (timeout ${MULTIGPU_TIMEOUT:-260} python -m pytest -m multigpu tests/gpu/test_multigpu.py -q -s -p no:cacheprovider \
      --basetemp=/tmp/mg; echo "rc=$?") > "$w/multigpu.txt" 2>&1
  mkdir -p "$w/multigpu_reports"
  (cd /tmp/mg && tar cf - --exclude='*.pt' --exclude='checkpoints' .) 2>/dev/null | tar xf - -C "$w/multigpu_reports"
  save
fi
if has sparse2d; then
  # 2D sparse parallelism (trainer.sharding_group_size): its 2-GPU test, then bench.sparse2d.
  (timeout ${SPARSE2D_TEST_TIMEOUT:-120} python -m pytest -m multigpu tests/gpu/test_multigpu_sparse2d.py -q -s \
      -p no:cacheprovider --basetemp=/tmp/mg2d; echo "rc=$?") > "$w/sparse2d_test.txt" 2>&1
  save
  (timeout ${SPARSE2D_TIMEOUT:-200} python -m bench.sparse2d --out "$w/sparse2d"; echo "rc=$?") > "$w/sparse2d.txt" 2>&1
  save
fi
if has comm; then
  # COMM_ARGS: more bench.comm arguments, e.g. the NE protocol "--ne-from 200 --ne-steps 100
  # --seeds 2" (raise COMM_TIMEOUT to match); its base checkpoint is deleted before the save.
  (timeout ${COMM_TIMEOUT:-130} python -m bench.comm --steps ${COMM_STEPS:-60} ${COMM_ARGS:-} --out "$w/comm"; echo "rc=$?") > "$w/comm.txt" 2>&1
  find "$w/comm" -type d -name checkpoints -prune -exec rm -rf {} + 2>/dev/null
  save
fi
if has scaling; then
  # SIGTERM from timeout: bench.scaling stops the running job's processes and keeps the jobs done.
  (timeout ${SCALING_TIMEOUT:-240} python -m bench.scaling --out "$w/scaling" ${SCALING_ARGS:-}; echo "rc=$?") > "$w/scaling.txt" 2>&1
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
  # One GPU, half the host's cores each (taskset): a host-bound run must not share cores with
  # its neighbour's compilation. Ratios are taken within one process.
  ncpu=$(nproc); half=$((ncpu / 2)); thr=$((half / 2 > 0 ? half / 2 : 1))
  fp8_pays() {  # GPU, cpus, runs as config:batch:seconds[:variants]
    for run in $3; do
      IFS=: read -r cfg b secs only extra <<< "$run"
      # A run naming its variants runs them alone (its own process: the memory figure).
      variants=${only:-${E2E_VARIANTS:-bf16+compile+graphs,loka_aggressive+compile+graphs,loka_safe+compile+graphs}}
      tag=${cfg}_b$b${only:+_$(echo "$only" | tr ',+' '__')}
      (CUDA_VISIBLE_DEVICES=$1 OMP_NUM_THREADS=$thr TORCHINDUCTOR_COMPILE_THREADS=$thr \
          timeout $secs taskset -c $2 python -m bench.e2e --configs $cfg --batches $b \
          --ne-steps 0 --steps 60 --profile-steps 5 --ledger ${E2E_EXTRA:-} ${extra//,/ } \
          ${E2E_PYPROFILE:+--pyprofile $w/fp8_pays_$tag/py} \
          --profile-variants ${E2E_PROFILE:-bf16+compile+graphs,loka_aggressive+compile+graphs} \
          --variants $variants --out $w/fp8_pays_$tag; echo "rc=$?") > $w/fp8_pays_$tag.txt 2>&1
      save
    done
  }
  fp8_pays 0 0-$((half - 1)) "${E2E_GPU0:-wukong:32768:550}" &
  fp8_pays 1 $half-$((ncpu - 1)) "${E2E_GPU1:-dcn:32768:300 dlrm:8192:130 dcn:8192:120}" &
fi
wait
save
