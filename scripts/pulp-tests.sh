#!/usr/bin/env bash
# The Pulp integration test: installs pulpcore 3.123.1 from PyPI and the Python client into a
# virtualenv under target/, then runs clients/python/tests/pulp against the broker binary
# (pulpcore's own migrations on a throwaway database, two pulpcore-broker-worker processes).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/ensure-pulp.sh
venv=target/pulp-venv
cargo build --quiet --bin dispatch-broker
cd clients/python
"../../$venv/bin/python" -m pytest -q -p no:cacheprovider -s tests/pulp
