#!/usr/bin/env bash
# Multi-GPU device runs in one call, in lanes side by side (device time is scarce). Usage on the
# device machine, from the repo root:
#   source .device/activate.sh; bash bench/device_multi.sh "$OUT" LANE [LANE...]
# A LANE is GPUS:PART[+PART...], e.g. "0,1:comm 2,3:multigpu+sparse2d" on 4 GPUs: its parts run
# one after another on those GPUs (CUDA_VISIBLE_DEVICES) and on the host cores that go with them
# (taskset: the host's cores split evenly over its GPUs), the lanes at the same time. A PART is a
# kind, optionally with a suffix that names its own arguments (ARGS_<part>) and time limit
# (TIMEOUT_<part>, seconds) and environment (ENV_<part>, NAME=VALUE words), e.g. scaling_dlrm with
# ARGS_scaling_dlrm="--configs dlrm":
#   multigpu*      python -m pytest -m multigpu tests/gpu/test_multigpu.py (ARGS: more pytest arguments, e.g. -k resumes)
#   sparse2dtest*  python -m pytest -m multigpu tests/gpu/test_multigpu_sparse2d.py (the 4-GPU tests run with 4 GPUs)
#   sparse2d*      python -m bench.sparse2d --out DIR ARGS (its NE base checkpoint is deleted before the save)
#   comm*          python -m bench.comm --out DIR ARGS (its NE base checkpoint is deleted before the save)
#   scaling*       python -m bench.scaling --out DIR ARGS (SIGTERM keeps the jobs done)
#   e2e*           python -m bench.e2e --out DIR ARGS (one GPU: a lane of one GPU)
#   probecost*     python -m bench.probe_cost --out DIR/probe_cost.json ARGS
#   pytest*        python -m pytest -q -s -p no:cacheprovider ARGS (e.g. tests/gpu/test_probe_gpu.py)
#   gemm*          python -m bench.gemm --out DIR ARGS (e.g. --parts b --quick --ms 32768)
#   ledgershapes*  python -m bench.ledger_shapes --out DIR ARGS
#   quanttiles*    python -m bench.quant_tiles --out DIR ARGS
#   producer*      python -m bench.producer_cast --out DIR ARGS
#   inference*     python -m bench.inference --out DIR ARGS
#   sampledfold*   python -m bench.sampled_fold --out DIR ARGS
# Each part's log ends with its return code and its wall time. $OUT returns at most 8 files: each
# lane's parts go into lane<i>.tgz (i: the lane's position, from 0; with the GPU list, the commit
# and the lanes), rewritten after each of its parts, so a call cut by its time limit still returns
# the parts it finished, and one lane's large output (profile traces) cannot keep the others from
# coming back.
set -u
out=$1
shift
known() {  # PART: whether part() runs it (the patterns of its case)
  case $1 in
    multigpu*|sparse2dtest*|sparse2d*|comm*|scaling*|e2e*|probecost*|gemm*|quanttiles*|producer*|inference*|sampledfold*|\
    ledgershapes*|pytest*) return 0 ;;
    *) return 1 ;;
  esac
}

# Every part named before any runs: a misspelt one stops the call at once, not after the others.
for spec in "$@"; do
  for p in $(tr '+' ' ' <<< "${spec#*:}"); do
    if ! known "$p"; then echo "device_multi.sh: unknown part '$p' in lane '$spec' (see the list at the top)" >&2; exit 2; fi
  done
done

tmp=${DEVICE_MULTI_TMP:-/tmp}  # where the parts write (a test points it elsewhere)
w=$tmp/multi
rm -rf "$w" "$tmp"/mg_*  # a warm machine still holds the last call's files
mkdir -p "$out" "$w"
save() {  # LANE_INDEX PART...: that lane's archive, with what its parts wrote so far
  local idx=$1 p items=(gpus.txt commit.txt lanes.txt)
  shift
  for p in "$@"; do
    for f in "$p.txt" "$p" "${p}_reports"; do [[ -e "$w/$f" ]] && items+=("$f"); done
  done
  tar czf "$out/lane$idx.tgz.tmp" -C "$w" "${items[@]}" && mv "$out/lane$idx.tgz.tmp" "$out/lane$idx.tgz"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$w/gpus.txt"
ngpu=$(nvidia-smi -L | wc -l)
per=$(( $(nproc) / ngpu ))
git rev-parse HEAD > "$w/commit.txt" 2>/dev/null
printf '%s\n' "$@" > "$w/lanes.txt"
env | grep -E '^(ARGS|TIMEOUT|ENV)_' | sort >> "$w/lanes.txt"

part() {  # GPUS CPUS PART
  local gpus=$1 cpus=$2 name=$3 args_var="ARGS_$3" limit_var="TIMEOUT_$3" env_var="ENV_$3"
  local args=${!args_var:-} limit=${!limit_var:-300} envs=${!env_var:-}
  local log="$w/$name.txt"
  echo "gpus $gpus cpus $cpus limit ${limit}s: ${envs:+$envs }$name $args" > "$log"
  local run=(env CUDA_VISIBLE_DEVICES=$gpus $envs timeout "$limit" taskset -c "$cpus" python)
  case $name in
    multigpu*) "${run[@]}" -m pytest -m multigpu tests/gpu/test_multigpu.py -q -s -p no:cacheprovider \
                   --basetemp="$tmp/mg_$name" $args >> "$log" 2>&1
               echo "rc=$?" >> "$log"
               mkdir -p "$w/${name}_reports"
               (cd "$tmp/mg_$name" && tar cf - --exclude='*.pt' --exclude='checkpoints' .) 2>/dev/null \
                   | tar xf - -C "$w/${name}_reports" ;;
    sparse2dtest*) "${run[@]}" -m pytest -m multigpu tests/gpu/test_multigpu_sparse2d.py -q -s -p no:cacheprovider \
                   --basetemp="$tmp/mg_$name" $args >> "$log" 2>&1; echo "rc=$?" >> "$log" ;;
    sparse2d*) "${run[@]}" -m bench.sparse2d --out "$w/$name" $args >> "$log" 2>&1; echo "rc=$?" >> "$log"
               find "$w/$name" -type d -name checkpoints -prune -exec rm -rf {} + 2>/dev/null
               find "$w/$name" -name '*.pt' -delete 2>/dev/null ;;
    comm*)     "${run[@]}" -m bench.comm --out "$w/$name" $args >> "$log" 2>&1; echo "rc=$?" >> "$log"
               find "$w/$name" -type d -name checkpoints -prune -exec rm -rf {} + 2>/dev/null ;;
    scaling*)  "${run[@]}" -m bench.scaling --out "$w/$name" $args >> "$log" 2>&1; echo "rc=$?" >> "$log"
               find "$w/$name" -type d -name checkpoints -prune -exec rm -rf {} + 2>/dev/null ;;
    e2e*)      "${run[@]}" -m bench.e2e --out "$w/$name" $args >> "$log" 2>&1; echo "rc=$?" >> "$log" ;;
    probecost*) mkdir -p "$w/$name"
               "${run[@]}" -m bench.probe_cost --out "$w/$name/probe_cost.json" $args >> "$log" 2>&1
               echo "rc=$?" >> "$log" ;;
    gemm*)     "${run[@]}" -m bench.gemm --out "$w/$name" $args >> "$log" 2>&1; echo "rc=$?" >> "$log" ;;
    quanttiles*) "${run[@]}" -m bench.quant_tiles --out "$w/$name" $args >> "$log" 2>&1; echo "rc=$?" >> "$log" ;;
    producer*) "${run[@]}" -m bench.producer_cast --out "$w/$name" $args >> "$log" 2>&1; echo "rc=$?" >> "$log" ;;
    inference*) "${run[@]}" -m bench.inference --out "$w/$name" $args >> "$log" 2>&1; echo "rc=$?" >> "$log" ;;
    ledgershapes*) "${run[@]}" -m bench.ledger_shapes --out "$w/$name" $args >> "$log" 2>&1; echo "rc=$?" >> "$log" ;;
    sampledfold*) "${run[@]}" -m bench.sampled_fold --out "$w/$name" $args >> "$log" 2>&1; echo "rc=$?" >> "$log" ;;
    pytest*)   "${run[@]}" -m pytest -q -s -p no:cacheprovider --basetemp="$tmp/mg_$name" $args >> "$log" 2>&1
               echo "rc=$?" >> "$log" ;;
    *) echo "unknown part $name" >> "$log" ;;
  esac
}

lane() {  # INDEX GPUS:PART+PART
  local idx=$1 gpus=${2%%:*} parts=${2#*:} cpus="" g p done=()
  for g in ${gpus//,/ }; do cpus+="${cpus:+,}$((g * per))-$((g * per + per - 1))"; done
  for p in ${parts//+/ }; do
    local started=$SECONDS
    part "$gpus" "$cpus" "$p"
    echo "wall $((SECONDS - started))s" >> "$w/$p.txt"  # what a part takes, to size the next limits
    done+=("$p")
    save "$idx" "${done[@]}"
  done
}

i=0
for spec in "$@"; do lane $i "$spec" & i=$((i + 1)); done
wait
