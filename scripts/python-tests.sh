#!/usr/bin/env bash
# The Python client's checks: builds and installs clients/python (with its test extras) into a
# virtualenv under target/, type-checks it with mypy --strict, and runs its pytest suite against
# the broker binary (`dispatch-sandbox` starts throwaway PostgreSQL and Redis per session).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

scripts/ensure-python.sh

venv=target/python-venv
[ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check "./clients/python[test]"
cargo build --quiet --workspace --bin dispatch-broker --bin dispatch-sandbox
cd clients/python
"../../$venv/bin/python" gen_stubs.py --check
"../../$venv/bin/python" -m mypy dispatch_broker_client
"../../$venv/bin/python" -m pytest -q -p no:cacheprovider
