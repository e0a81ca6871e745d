#!/usr/bin/env bash
# The one-GPU device runs: the GPU tests, then the end-to-end, Dispatch, Mods and GEMM
# benchmarks, each under its own time limit so that one slow part cannot eat the rest.
# Usage on the device machine, from the repo root (carry .device; .whl for torchao):
#   source .device/activate.sh && bash bench/device_h100.sh "$OUT" [PART...]
# PARTS: tests e2e dispatch mods gemm_a gemm_bc quant_ab torchao ne_floor rotated batches pin frame_skip
# trace vs_torchao probe_steps ne_pairs ne_decay wukong_rowwise dlrm_torchao fp8_pays ledger_shapes comm_codec
# overhead probe_cost.
# One 600 s call each for `rotated` (E2E_CONFIGS of one config) and `batches`. One 600 s call each
# for `quant_ab`, `torchao` and `ne_floor`. One 600 s call each for: `tests`, `e2e` with
# E2E_CONFIGS of one or two configs (wukong+dcn, 5 variants, 40 timed steps: ~230 s). bench.e2e's defaults are now 100 timed steps and NE after 2000 steps on 32 eval batches;
# the parts below pin NE after 200 steps on 8 batches (E2E_NE) where their time limits assume it,
# except ne_floor. One call for `dispatch mods`, `gemm_a`,
# `gemm_bc` (gemm_bc appends to gemm_a's report, so run them on the same warm machine).
# Knobs: E2E_CONFIGS, E2E_ARGS, E2E_TIMEOUT, MODS_MODELS, MODS_TIMEOUT, DISPATCH_BACKENDS,
# DISPATCH_TIMEOUT, TESTS_TIMEOUT. Each benchmark runs in pieces that save as they go, so a
# time limit loses at most the piece running.
set -u
out=$1
shift
parts=${*:-tests}
# The NE protocol of the timed parts (their limits were measured with it; ne_floor sets its own).
E2E_NE=${E2E_NE:---ne-steps 200 --eval-batches 8}
DISPATCH_BACKENDS=${DISPATCH_BACKENDS:-fbgemm_rowwise,torch_scaled_mm}
has() { [[ " $parts " == *" $1 "* ]]; }
w=/tmp/h100
rm -rf "$w"  # a warm machine still holds the last call's files
mkdir -p "$out" "$w"
# $OUT returns at most a handful of files: everything goes into one archive, rewritten after
# every part, so a call killed by its time limit still returns the parts it finished.
save() { tar czf "$out/h100.tgz.tmp" -C /tmp h100 && mv "$out/h100.tgz.tmp" "$out/h100.tgz"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpus.txt"
# GPU clocks, power and temperature every second (does the GPU slow down over a call?).
q=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu
nvidia-smi --query-gpu=$q,clocks_event_reasons.active --format=csv > /dev/null 2>&1 && q=$q,clocks_event_reasons.active
nvidia-smi --query-gpu=$q --format=csv -l 1 > "$w/smi.csv" 2>&1 &
smi=$!
trap 'kill $smi 2> /dev/null' EXIT
if has tests; then
  # One fixed Triton GEMM config: with autotuning the suite did not finish in 190 s, and tuning
  # each test shape (~9 compiles) is the likely cost (not yet measured: see --durations).
  (LOKA_TRITON_AUTOTUNE=0 timeout ${TESTS_TIMEOUT:-240} python -m pytest tests/gpu -m "not multigpu" -q \
      -p no:cacheprovider -rfs --durations=15; echo "rc=$?") \
      > "$w/gpu_tests.txt" 2>&1
  save
fi
if has e2e; then
  (timeout ${E2E_TIMEOUT:-400} python -m bench.e2e --configs ${E2E_CONFIGS:-wukong,dcn} $E2E_NE \
      ${E2E_ARGS:-} --out $w/e2e; echo "rc=$?") > $w/e2e.txt 2>&1
  save
fi
if has dispatch; then
  for cfg in dlrm dcn wukong; do
    # cuBLAS/CUTLASS/FBGEMM candidates: the Triton GEMM's autotuning alone outlasts the call.
    (timeout ${DISPATCH_TIMEOUT:-90} python -m bench.dispatch --iters 20 --configs $cfg --backends "$DISPATCH_BACKENDS" \
        --out $w/dispatch_$cfg; \
        echo "rc=$?") > $w/dispatch_$cfg.txt 2>&1
    save
  done
fi
if has mods; then
  for model in ${MODS_MODELS:-wukong dcn}; do
    (timeout ${MODS_TIMEOUT:-150} python -m bench.mods --models $model --out $w/mods_$model; echo "rc=$?") \
        > $w/mods_$model.txt 2>&1
    save
  done
fi
gemm_pieces() {
  for piece in "$@"; do
    append=$([ -e $w/gemm/gemm.json ] && echo --append)
    (timeout 170 python -m bench.gemm $piece $append --out $w/gemm; echo "rc=$?") \
        >> $w/gemm.txt 2>&1
    save
  done
}
if has gemm_a; then gemm_pieces "--parts a --ms 2048" "--parts a --ms 8192" "--parts a --ms 32768"; fi
if has gemm_bc; then gemm_pieces "--parts b" "--parts c"; fi
# Does FP8 pay under compile + graphs when inductor quantizes? The same run with the Triton
# custom-op quantizers (default) and with LOKA_COMPILED_QUANTIZER=inductor, traced.
if has quant_ab; then
  for mode in custom inductor; do
    (LOKA_COMPILED_QUANTIZER=$mode timeout 280 python -m bench.e2e --configs wukong $E2E_NE \
        --variants bf16+compile+graphs,loka_safe+compile+graphs --profile-variants loka_safe+compile+graphs \
        --trace $w/traces_$mode --out $w/e2e_quant_$mode; echo "rc=$?") > $w/e2e_quant_$mode.txt 2>&1
    save
  done
fi
# torchao's recipes compiled and CUDA-graphed, beside LoKA's fastest setting.
if has torchao; then
  (timeout 560 python -m bench.e2e --configs ${E2E_CONFIGS:-wukong} --no-profile $E2E_NE \
      --variants bf16,bf16+compile+graphs,loka_safe+compile+graphs,torchao_tensorwise+graphs,torchao_rowwise+graphs \
      --out $w/e2e_torchao; echo "rc=$?") > $w/e2e_torchao.txt 2>&1
  save
fi
# The NE protocol's noise floor: bf16 and bf16+graphs run the same kernels, so their NE gap
# after 2000 steps is noise (2000 distinct train batches of 8192: about 7 GB of host memory).
# LoKA at that horizon is a second call: E2E_NE_VARIANTS=bf16,loka_safe+compile+graphs.
if has ne_floor; then
  (timeout 560 python -m bench.e2e --configs wukong --no-profile --ne-steps 2000 --eval-batches 32 \
      --repeats 3 --variants ${E2E_NE_VARIANTS:-bf16,bf16+graphs} \
      --out $w/e2e_ne_floor; echo "rc=$?") > $w/e2e_ne_floor.txt 2>&1
  save
fi
# Speed in rotated rounds (the order confounds single runs: step times drift 30-50% within one
# process on an H100): 3 rounds of bf16, its compiled + graphed form, torchao tensor-wise and
# LoKA safe; NE only after the 120 timed steps (the NE protocol is ne_floor's). One config a call;
# E2E_BATCHES picks the batch (default 8192).
ROTATED_VARIANTS=${ROTATED_VARIANTS:-bf16,bf16+compile+graphs,torchao_tensorwise+graphs,loka_safe+compile+graphs}
if has rotated; then
  r=e2e_rotated_${E2E_CONFIGS:-wukong}_b${E2E_BATCHES:-8192}
  (timeout ${E2E_TIMEOUT:-560} python -m bench.e2e --configs ${E2E_CONFIGS:-wukong} --ne-steps 0 --repeats 3 \
      --batches ${E2E_BATCHES:-8192} --variants $ROTATED_VARIANTS \
      --profile-variants bf16+compile+graphs,loka_safe+compile+graphs ${ROTATED_ARGS:-} \
      --out $w/$r; echo "rc=$?") > $w/$r.txt 2>&1
  save
fi
# Issue 9's other batch sizes (E2E_BATCHES, default 4096 and 32768), one round each.
if has batches; then
  (timeout ${E2E_TIMEOUT:-560} python -m bench.e2e --configs ${E2E_CONFIGS:-dlrm,dcn,wukong} --ne-steps 0 \
      --batches ${E2E_BATCHES:-4096,32768} --variants $ROTATED_VARIANTS \
      --profile-variants bf16+compile+graphs,loka_safe+compile+graphs \
      ${BATCHES_ARGS:-} --out $w/e2e_batches; echo "rc=$?") > $w/e2e_batches.txt 2>&1
  save
fi
# Pinned against pageable train batches (trainer.pin_memory), in rotated rounds, on the
# host-bound configs; the pinning GPU test first.
if has pin; then
  (timeout 60 python -m pytest tests/gpu/test_data_gpu.py -q -p no:cacheprovider; echo "rc=$?") > $w/pin_test.txt 2>&1
  (timeout ${E2E_TIMEOUT:-500} python -m bench.e2e --configs ${E2E_CONFIGS:-dcn,dlrm} --ne-steps 0 --repeats 3 \
      --variants bf16+compile+graphs,bf16+compile+graphs+pageable \
      --profile-variants bf16+compile+graphs,bf16+compile+graphs+pageable \
      --out $w/e2e_pin; echo "rc=$?") > $w/e2e_pin.txt 2>&1
  save
fi
# The layer-loop frame skip (bench/results/e2e_rotated_batches_h100_2026-11-24b): the graphs and
# pinning GPU tests, then LoKA safe against bf16, both compiled and graphed, at batch 32768 where
# Dispatch picks FP8 (DCN: 23 ms against 14 ms with the skip). FIX_VARIANTS adds variants.
if has frame_skip; then
  (LOKA_TRITON_AUTOTUNE=0 timeout ${FIX_TESTS_TIMEOUT:-120} python -m pytest \
      ${FIX_TESTS:-tests/gpu/test_opaque_gpu.py tests/gpu/test_graphs_gpu.py tests/gpu/test_data_gpu.py} \
      -q -p no:cacheprovider -rfs; echo "rc=$?") > $w/fix_tests.txt 2>&1
  save
  (timeout ${E2E_TIMEOUT:-420} python -m bench.e2e --configs ${E2E_CONFIGS:-dcn,wukong} --ne-steps 0 \
      --batches ${E2E_BATCHES:-32768} --variants ${FIX_VARIANTS:-bf16+compile+graphs,loka_safe+compile+graphs} \
      --profile-variants bf16+compile+graphs,loka_safe+compile+graphs \
      --out $w/e2e_fix; echo "rc=$?") > $w/e2e_fix.txt 2>&1
  save
fi
# Kernel attribution: the profiled windows written as traces and attributed to the aten operator
# that launched each kernel (bench.trace_ops). Without +graphs, since a graph's kernels all
# correlate to one cudaGraphLaunch. The traces stay out of the archive (tens of MB each).
if has trace; then
  t=/tmp/h100_traces
  rm -rf $t
  (timeout ${TRACE_TIMEOUT:-170} python -m bench.e2e --configs ${TRACE_CONFIGS:-dcn} --ne-steps 0 \
      --batches ${TRACE_BATCHES:-32768} --steps 30 --variants ${TRACE_VARIANTS:-bf16+compile,loka_safe+compile} \
      --profile-variants ${TRACE_VARIANTS:-bf16+compile,loka_safe+compile} --trace $t \
      --out $w/e2e_trace; echo "rc=$?") > $w/e2e_trace.txt 2>&1
  for f in $t/*.json.gz; do
    [ -e "$f" ] || continue
    (timeout 45 python -m bench.trace_ops "$f" --steps 5 --top 40; echo "rc=$?") > "$w/ops_$(basename "$f" .json.gz).txt" 2>&1
  done
  save
fi
# Speed runs, LoKA first in every list (a part that hits its limit then still has LoKA). Each
# piece has its own limit and saves when it ends. H100 timings: Wukong at 32768 takes ~8 s of
# data, then per variant LoKA ~100 s (decision run included), bf16 12, bf16+c+g 50, torchao
# 75-80 s; DLRM at 32768 ~120 s for all five.
#   vs_torchao: Wukong, then DLRM, at 32768 against both torchao recipes (~450 s, one call)
#   probe_steps: the Probe's sampled steps over 400 timed steps of DCN at 32768, then DCN at
#           8192 in 2 rotated rounds against bf16 (~380 s, one call)
V=loka_safe+compile+graphs,bf16,bf16+compile+graphs,torchao_tensorwise+graphs,torchao_rowwise+graphs
if has vs_torchao; then
  for cfg in wukong dlrm; do
    (timeout $([ $cfg = wukong ] && echo 340 || echo 150) python -m bench.e2e --configs $cfg --ne-steps 0 \
        --batches 32768 --steps 50 --variants $V --profile-variants bf16+compile+graphs,loka_safe+compile+graphs \
        --out $w/e2e_next_$cfg; echo "rc=$?") > $w/e2e_next_$cfg.txt 2>&1
    save
  done
fi
if has probe_steps; then
  (timeout 170 python -m bench.e2e --configs dcn --ne-steps 0 --batches 32768 --steps 400 --no-profile \
      --variants loka_safe+compile+graphs,bf16+compile+graphs --out $w/e2e_next_probe; echo "rc=$?") \
      > $w/e2e_next_probe.txt 2>&1
  save
  (timeout 250 python -m bench.e2e --configs dcn --ne-steps 0 --batches 8192 --repeats 2 \
      --variants loka_safe+compile+graphs,bf16,bf16+compile+graphs \
      --profile-variants bf16+compile+graphs,loka_safe+compile+graphs \
      --out $w/e2e_next_dcn8192; echo "rc=$?") > $w/e2e_next_dcn8192.txt 2>&1
  save
fi
# Does a shared checkpoint make NE deltas resolvable? Paired continuations (--ne-from): per seed
# bf16 trains 1000 steps of DCN at 8192, then bf16 (the resume itself), bf16+graphs (the noise
# floor: the same kernels) and LoKA safe + graphs each train 300 more steps from it (~260 s).
if has ne_pairs; then
  (timeout ${NE_PAIRS_TIMEOUT:-500} python -m bench.e2e --configs ${E2E_CONFIGS:-dcn} --ne-from 1000 --ne-steps 300 \
      --eval-batches 32 --repeats 3 --no-profile --variants bf16,bf16+graphs,loka_safe+graphs \
      --out $w/e2e_ne_pairs; echo "rc=$?") > $w/e2e_ne_pairs.txt 2>&1
  save
fi
# Paired continuations that end with the learning rates decayed to 0 (--ne-decay 1.0): on the CPU
# (tiny DCN, 8 seeds) they cut the seed-paired NE sd from 0.13% (independent runs, constant rates)
# to 0.05-0.06%. Per seed bf16 trains 1000 steps of DCN at 8192, then each variant 300 decaying
# steps from it. NE_REPEATS seeds (default 4), NE_VARIANTS as below.
if has ne_decay; then
  (timeout ${NE_DECAY_TIMEOUT:-540} python -m bench.e2e --configs ${E2E_CONFIGS:-dcn} --ne-from 1000 --ne-steps 300 \
      --ne-decay 1.0 --eval-batches 32 --repeats ${NE_REPEATS:-4} --no-profile --batches 8192 \
      --variants ${NE_VARIANTS:-bf16,bf16+compile+graphs,loka_safe+compile+graphs} \
      --out $w/e2e_ne_decay; echo "rc=$?") > $w/e2e_ne_decay.txt 2>&1
  save
fi
# Wukong at 32768 against torchao row-wise, then where LoKA's slow steps on DCN come from
# (--step-diag: host time and allocator calls of each slow step).
if has wukong_rowwise; then
  (timeout 300 python -m bench.e2e --configs wukong --ne-steps 0 --batches 32768 --steps 50 --no-profile \
      --variants loka_safe+compile+graphs,torchao_rowwise+graphs,bf16+compile+graphs \
      --out $w/e2e_next_wukong_rowwise; echo "rc=$?") > $w/e2e_next_wukong_rowwise.txt 2>&1
  save
  (timeout 150 python -m bench.e2e --configs dcn --ne-steps 0 --batches 32768 --steps 400 --no-profile --step-diag \
      --variants loka_safe+compile+graphs,bf16+compile+graphs --out $w/e2e_step_diag; echo "rc=$?") \
      > $w/e2e_step_diag.txt 2>&1
  save
fi
# DLRM at 32768 against both torchao recipes: 4 rotated rounds after a discarded warm run (every
# variant speeds up over a host-bound process's first runs). LoKA ~100 s for its first run
# (decision + compile), then ~20 s; torchao 5-20 s a run.
if has dlrm_torchao; then
  (timeout 500 python -m bench.e2e --configs dlrm --ne-steps 0 --batches 32768 --steps 50 --repeats 4 \
      --no-profile --warm-run --variants loka_safe+compile+graphs,torchao_rowwise+graphs,torchao_tensorwise+graphs,bf16+compile+graphs \
      --out $w/e2e_dlrm_torchao; echo "rc=$?") > $w/e2e_dlrm_torchao.txt 2>&1
  save
fi
# Does FP8 pay against bf16 with the same settings? Each config at 32768, LoKA first, with the
# per-GEMM ledger and peak memory in the report (~250-470 s for Wukong, one call per config).
if has fp8_pays; then
  for cfg in ${E2E_CONFIGS:-wukong}; do
    (timeout ${E2E_TIMEOUT:-560} python -m bench.e2e --configs $cfg --batches ${E2E_BATCHES:-32768} --ne-steps 0 \
        --steps 60 --no-profile --ledger \
        --variants loka_aggressive+compile+graphs,loka_safe+compile+graphs,bf16+compile+graphs \
        --out $w/e2e_fp8_pays_$cfg; echo "rc=$?") > $w/e2e_fp8_pays_$cfg.txt 2>&1
    save
  done
fi
# What LoKA costs when nothing runs in FP8 (host-bound batch 8192): bf16, the converted sites
# alone (loka_high) and LoKA safe, all + compile + graphs, in one process (the ratios, each run's
# step times split into the Probe's sampled and unsampled steps) and then each variant in its
# own process (the memory figures), with a trace of the profiled steps (~4 min).
if has overhead; then
  # Batch 8192 is host-bound: every (variant, round) in its own process (--isolate), three rotated
  # rounds, each run's profile kept (a run leaves state that slows the later runs of a process).
  for cfg in ${E2E_CONFIGS:-dlrm}; do
    (timeout ${E2E_TIMEOUT:-330} python -m bench.e2e --configs $cfg --batches 8192 --ne-steps 0 --steps 300 \
        --isolate --repeats 3 --profile-steps 5 \
        --profile-variants bf16+compile+graphs,loka_high+compile+graphs,loka_safe+compile+graphs \
        --variants bf16+compile+graphs,loka_high+compile+graphs,loka_safe+compile+graphs \
        --out $w/overhead_$cfg; echo "rc=$?") > $w/overhead_$cfg.txt 2>&1
    save
  done
fi
# One Probe sample of over-arch 0's GEMMs (32768 x 4096 -> 4096), with and without the column cut (~40 s).
if has probe_cost; then
  (timeout 60 python -m bench.probe_cost --out $w/probe_cost_cut.json; echo "rc=$?") > $w/probe_cost_cut.txt 2>&1
  (timeout 60 python -m bench.probe_cost --max-cols none --out $w/probe_cost_full.json; echo "rc=$?") > $w/probe_cost_full.txt 2>&1
  save
fi
# The ledger at named shapes (bench.ledger_shapes, ~110 s) and the comm codec per MB (~60 s).
if has ledger_shapes; then
  (timeout 300 python -m bench.ledger_shapes --out $w/ledger_shapes --batch ${LEDGER_BATCH:-32768} \
      --backends torch_scaled_mm triton; echo "rc=$?") > $w/ledger_shapes.txt 2>&1
  save
fi
if has comm_codec; then
  (timeout 200 python -m bench.comm_codec --out $w/comm_codec; echo "rc=$?") > $w/comm_codec.txt 2>&1
  save
fi
