#!/usr/bin/env bash
# Makes sure Python 3.10+ with venv is there for the Python client's and the Pulp tests: installs
# python3 and python3-venv with apt-get when possible, otherwise stops naming what to install.
set -euo pipefail
PY=${PYTHON:-python3}
ok() { "$PY" -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 10))' >/dev/null 2>&1; }
ok && exit 0
if command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" = 0 ] || command -v sudo >/dev/null 2>&1; }; then
  echo "installing python3 and python3-venv with apt-get ..."
  run() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
  export DEBIAN_FRONTEND=noninteractive
  run apt-get update -qq
  run apt-get install -y -qq python3 python3-venv >/dev/null
  ok && exit 0
fi
echo "the Python tests need Python 3.10 or newer with venv: install python3 and python3-venv" >&2
exit 1
