# The two set-up commands: `make demo` runs the broker on throwaway PostgreSQL and Redis with a
# scripted exchange of workers and tasks; `make test` runs every test. Both install what they need.

CARGO ?= cargo

.PHONY: demo test test-rust test-python test-pulp python-stubs build lint fmt bench

demo:
	@scripts/ensure-services.sh
	$(CARGO) run --release --quiet -p dispatch-testkit --bin dispatch-demo

test: test-rust test-python test-pulp

test-rust:
	@scripts/ensure-services.sh
	$(CARGO) test --workspace

# The Python client (clients/python) against the real broker.
test-python:
	@scripts/ensure-services.sh
	scripts/python-tests.sh

# Real Pulp (pulpcore 3.123.1 from PyPI, its own migrations) with two broker-backed workers.
test-pulp:
	@scripts/ensure-services.sh
	scripts/pulp-tests.sh

# Regenerates the Python client's gRPC stubs from proto/ (a test fails while they are stale).
python-stubs:
	@[ -x target/python-venv/bin/python ] || scripts/python-tests.sh
	target/python-venv/bin/python clients/python/gen_stubs.py

build:
	$(CARGO) build --release --workspace

lint:
	$(CARGO) fmt --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

fmt:
	$(CARGO) fmt

bench:
	@scripts/ensure-services.sh
	$(CARGO) bench --bench lanes
	$(CARGO) bench --bench fetch
	$(CARGO) bench --bench idle
	$(CARGO) bench --bench load
	$(CARGO) bench --bench admin
	$(CARGO) bench --bench pulp
