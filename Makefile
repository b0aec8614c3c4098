# The two set-up commands: `make demo` runs the broker on throwaway PostgreSQL and Redis with a
# scripted exchange of workers and tasks; `make test` runs every test. Both install what they need.

CARGO ?= cargo

.PHONY: demo test build lint fmt bench

demo:
	@scripts/ensure-services.sh
	$(CARGO) run --release --quiet -- demo

test:
	@scripts/ensure-services.sh
	$(CARGO) test

build:
	$(CARGO) build --release

lint:
	$(CARGO) fmt --check
	$(CARGO) clippy --all-targets -- -D warnings

fmt:
	$(CARGO) fmt

bench:
	@scripts/ensure-services.sh
	$(CARGO) bench --bench lanes
