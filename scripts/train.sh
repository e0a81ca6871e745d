#!/usr/bin/env bash
# The main job: a sharded DLRM on 2 CPU processes (torchrun, gloo) with synthetic data.
# Extra arguments are hydra overrides, e.g. `./scripts/train.sh model=dcn trainer.steps=500`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/ensure_env.sh"
cd "$root"
nproc="${LOKA_NPROC:-2}"
# launch/torchrun.py: torchrun, without its failure report after the job's own message.
exec .venv/bin/python launch/torchrun.py --standalone --nproc_per_node="$nproc" launch/train.py "$@"
