# Sourced by the other scripts: make sure .venv exists and holds tether with the given extras.
# On a fresh Debian machine `python3 -m venv` needs the python3-venv package; install it when we can.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  if ! "$PY" -m venv .venv 2>/dev/null; then
    rm -rf .venv
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null
      "$PY" -m venv .venv
    else
      echo "error: cannot create a virtual environment; install it with: sudo apt-get install -y python3-venv" >&2
      exit 1
    fi
  fi
fi
# skip pip when nothing it would change has: the same pyproject.toml, extras and interpreter as the last install
# (the install is editable, so the source itself needs none); delete .venv/.tether-installed to force one
# the install is editable: pip compiles nothing of src/, and with PYTHONDONTWRITEBYTECODE set (as on many CI and
# dev machines) Python never writes the .pyc files, so every `tether` run would compile all its modules from source
# (1.3x the CPU of `tether exec`); compileall writes them whatever that variable says and skips those up to date
.venv/bin/python -m compileall -q -j 0 src/tether >/dev/null || true
STAMP=.venv/.tether-installed
WANT="$(cat pyproject.toml | sha256sum | cut -c1-16) $(.venv/bin/python -c 'import sys; print(sys.version.split()[0])') ${TETHER_EXTRAS:-[]}"
if [ -x .venv/bin/tether ] && [ -f "$STAMP" ] && grep -qxF -- "$WANT" "$STAMP"; then
  return 0 2>/dev/null || exit 0
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e ".${TETHER_EXTRAS:-}"
# keep the lines of this pyproject.toml (other extras installed before), drop those of an older one
{ grep -F -- "${WANT%% *} " "$STAMP" 2>/dev/null || true; echo "$WANT"; } | sort -u > "$STAMP.new" && mv "$STAMP.new" "$STAMP"
