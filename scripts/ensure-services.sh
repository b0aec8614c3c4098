#!/usr/bin/env bash
# Makes sure the PostgreSQL and Redis server binaries the tests and the demo start are installed.
# Installs them with apt-get when possible; otherwise stops at once naming what to install.
# The tests start their own throwaway servers on free ports; nothing here starts a service.
set -euo pipefail

have_postgres() {
  command -v initdb >/dev/null 2>&1 && command -v postgres >/dev/null 2>&1 && return 0
  ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1
}
have_psql() { command -v psql >/dev/null 2>&1; }
have_redis() { command -v redis-server >/dev/null 2>&1; }
have_cargo() { command -v cargo >/dev/null 2>&1; }

if ! have_cargo; then
  echo "cargo is not installed: install Rust (https://rustup.rs) and run this again" >&2
  exit 1
fi

missing=()
have_postgres && have_psql || missing+=(postgresql)
have_redis || missing+=(redis-server)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing ${missing[*]} with apt-get ..."
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${missing[@]}" >/dev/null
  elif command -v sudo >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    echo "installing ${missing[*]} with sudo apt-get ..."
    sudo DEBIAN_FRONTEND=noninteractive apt-get update -qq
    sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "missing: ${missing[*]}; install them with: apt-get install -y ${missing[*]}" >&2
    exit 1
  fi
fi
# Debian starts the packaged services on install; the tests do not use them (they start their own).
have_postgres && have_psql && have_redis || { echo "PostgreSQL or Redis binaries still missing after install" >&2; exit 1; }
if [ "$(id -u)" = 0 ] && ! id postgres >/dev/null 2>&1; then
  echo "running as root, but there is no 'postgres' user to run the throwaway PostgreSQL as; install the postgresql package" >&2
  exit 1
fi
