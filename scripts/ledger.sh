#!/usr/bin/env bash
# The per-GEMM ledger of a config: a few training steps with the LoKA callback (so that the Probe
# and Dispatch see the real shapes and plans), then, on rank 0, each GEMM's high-precision time,
# every FP8 candidate's GEMM and quantization time as the site runs them, and the step speed-ups
# they predict. Printed, and written to runs/ledger/latest/loka/ledger.{md,json}.
# Extra arguments are hydra overrides, e.g. `./scripts/ledger.sh model=wukong trainer=gpu`.
# On a CPU FP8 is emulated: the ledger runs, but its times say nothing of a GPU.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/ensure_env.sh"
cd "$root"
nproc="${LOKA_NPROC:-2}"
exec .venv/bin/python launch/torchrun.py --standalone --nproc_per_node="$nproc" launch/train.py \
    trainer.steps=60 trainer.eval_every=0 trainer.checkpoint_at_end=false trainer.resume=never \
    trainer.out_dir=runs/ledger loka.ledger=true "$@"
