#!/usr/bin/env bash
# Create .venv/ in the project root and install the pinned CPU stack, once.
# Re-runs the install when pyproject.toml changes (a stamp holds its hash).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
stamp="$venv/.loka_stamp"
want="$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    exit 0
fi
py="${PYTHON:-python3.11}"
command -v "$py" >/dev/null 2>&1 || py=python3
echo "[loka_train] setting up $venv (first run only, about 2 minutes)" >&2
[[ -x "$venv/bin/python" ]] || "$py" -m venv "$venv"
readarray -t groups < <("$venv/bin/python" - "$root/pyproject.toml" <<'PY'
import sys, tomllib
cfg = tomllib.load(open(sys.argv[1], "rb"))
opt = cfg["project"]["optional-dependencies"]
print(" ".join(cfg["project"]["dependencies"] + opt["cpu"] + opt["dev"]))
print(" ".join(cfg["tool"]["loka_train"]["install"]["no_deps"]))
PY
)
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
# shellcheck disable=SC2086
"${pip[@]}" ${groups[0]}
# shellcheck disable=SC2086
"${pip[@]}" --no-deps ${groups[1]}
"${pip[@]}" --no-deps --no-build-isolation -e "$root"
echo "$want" > "$stamp"
echo "[loka_train] environment ready" >&2
