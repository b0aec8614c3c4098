//! The integration tests, one module per capability, in one test binary: the harness
//! (`tests/support/harness.rs`) is compiled once, and the tests share one throwaway PostgreSQL
//! cluster (each test gets a database of its own) while starting their own Redis, brokers and,
//! where a test kills Postgres, a cluster of their own. `tests/chaos.rs` is a binary of its own
//! (its own main, for `--long` runs).

#[path = "../support/harness.rs"]
mod support;

mod admin;
mod bad_input;
mod cancel;
mod deploy;
mod errors;
mod fairness;
mod fetch;
mod hol_blocking;
mod lanes;
mod leak_paths;
mod leases;
mod longpoll;
mod outages;
mod pulp_schema;
mod readiness_prop;
mod security;
mod startup;
mod worker;
