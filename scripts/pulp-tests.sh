#!/usr/bin/env bash
# The Pulp integration test: installs pulpcore 3.123.1 from PyPI and the Python client into a
# virtualenv under target/, then runs clients/python/tests/pulp against the broker binary
# (pulpcore's own migrations on a throwaway database, two pulpcore-broker-worker processes).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/ensure-pulp.sh
venv=target/pulp-venv
cargo build --quiet --workspace --bin dispatch-broker --bin dispatch-sandbox
cd clients/python
report=$(mktemp)
trap 'rm -f "$report"' EXIT
# The client's own test run leaves tests/pulp out (pyproject's addopts); here it is all that runs.
"../../$venv/bin/python" -m pytest -q -p no:cacheprovider -o addopts= -rs --junitxml="$report" -s tests/pulp
# Passing is not enough: the run must have run tests and skipped none.
"../../$venv/bin/python" - "$report" <<'PY'
import sys
import xml.etree.ElementTree as ET

root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
ran = sum(int(s.get("tests", 0)) for s in suites)
skipped = sum(int(s.get("skipped", 0)) for s in suites)
if ran == 0 or skipped:
    sys.exit(f"pulp tests: {ran} collected, {skipped} skipped; every Pulp test must run")
PY
