#!/usr/bin/env bash
# An export of a trained run for inference: its model and LoKA plans from its checkpoint, each
# FP8 site served with its weight quantized once, evaluated next to the same weights in high
# precision, and its numerics per site. Extra arguments are hydra overrides of conf/export.yaml,
# e.g. `./scripts/export.sh run=runs/latest dtype=fp32`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/ensure_env.sh"
cd "$root"
exec .venv/bin/python launch/export.py "$@"
