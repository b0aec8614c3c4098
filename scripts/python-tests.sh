#!/usr/bin/env bash
# The Python client's checks: builds and installs clients/python (with its test extras) into a
# virtualenv under target/, type-checks it with mypy --strict, and runs its pytest suite against
# the broker binary (`dispatch-broker sandbox` starts throwaway PostgreSQL and Redis per session).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if ! "$PY" -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 10))' >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing python3 and python3-venv with apt-get ..."
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq python3 python3-venv >/dev/null
  else
    echo "the Python client's tests need Python 3.10 or newer with venv: install python3 and python3-venv" >&2
    exit 1
  fi
fi

venv=target/python-venv
[ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check "./clients/python[test]"
cargo build --quiet --bin dispatch-broker
cd clients/python
"../../$venv/bin/python" gen_stubs.py --check
"../../$venv/bin/python" -m mypy dispatch_broker_client
"../../$venv/bin/python" -m pytest -q -p no:cacheprovider
