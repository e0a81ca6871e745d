#!/usr/bin/env bash
# The tests: lint (ruff), type check (mypy), then the CPU test suite (GPU tests skip).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/ensure_env.sh"
cd "$root"
.venv/bin/ruff check loka_train launch tests bench
.venv/bin/mypy
# pytest exits 5 when it collects no tests: that fails this script too.
exec .venv/bin/python -m pytest -q tests "$@"
