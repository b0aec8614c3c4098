#!/usr/bin/env bash
# Makes target/pulp-venv: pulpcore 3.123.1 from PyPI and the Python client, for the Pulp
# integration test (make test-pulp) and the Pulp benchmark (cargo bench --bench pulp).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
scripts/ensure-python.sh
venv=target/pulp-venv
[ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check "pulpcore==3.123.1" "./clients/python[test]"
