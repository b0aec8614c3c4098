"""Fixtures: a real broker on throwaway PostgreSQL and Redis (`dispatch-broker sandbox`), and a
database connection to insert tasks and read their state."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import psycopg
import pytest

REPO = pathlib.Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "clients" / "python"))


def broker_binary() -> str:
    path = os.environ.get("DISPATCH_BROKER_BIN") or str(REPO / "target" / "debug" / "dispatch-broker")
    if not os.path.exists(path):
        pytest.exit(f"no broker binary at {path}: run `cargo build` first (or set DISPATCH_BROKER_BIN)", 2)
    return path


@dataclass
class Sandbox:
    endpoint: str
    address: str
    postgres_url: str
    redis_url: str
    process: subprocess.Popen[str]


def start_sandbox(*extra: str) -> Sandbox:
    process = subprocess.Popen(
        [broker_binary(), "sandbox", *extra],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line:
        raise RuntimeError(f"dispatch-broker sandbox exited with {process.wait()} before it served")
    info = json.loads(line)
    return Sandbox(info["endpoint"], info["address"], info["postgres_url"], info["redis_url"], process)


def stop_sandbox(sandbox: Sandbox) -> None:
    assert sandbox.process.stdin is not None
    sandbox.process.stdin.close()  # the sandbox serves until its stdin ends
    sandbox.process.wait(timeout=30)


@pytest.fixture(scope="session")
def sandbox() -> Iterator[Sandbox]:
    box = start_sandbox()
    yield box
    stop_sandbox(box)


class Db:
    """Inserts tasks the way Pulp does (waiting rows) and reads them back."""

    def __init__(self, url: str):
        self.conn = psycopg.connect(url, autocommit=True)

    def task(self, *record: str, name: str = "test.task") -> str:
        task_id = str(uuid.uuid4())
        self.conn.execute(
            "INSERT INTO core_task (pulp_id, name, state, reserved_resources_record) VALUES (%s, %s, 'waiting', %s)",
            (task_id, name, list(record)),
        )
        return task_id

    def state(self, task_id: str) -> str:
        row = self.conn.execute("SELECT state FROM core_task WHERE pulp_id = %s", (task_id,)).fetchone()
        assert row is not None
        return str(row[0])

    def app_lock(self, task_id: str) -> str | None:
        row = self.conn.execute("SELECT app_lock_id FROM core_task WHERE pulp_id = %s", (task_id,)).fetchone()
        assert row is not None
        return None if row[0] is None else str(row[0])


@pytest.fixture
def db(sandbox: Sandbox) -> Iterator[Db]:
    d = Db(sandbox.postgres_url)
    yield d
    # Each test starts with an empty queue: what a test left waiting must not reach the next.
    d.conn.execute("UPDATE core_task SET state = 'canceled' WHERE state IN ('waiting', 'running', 'canceling')")
    d.conn.close()


@pytest.fixture
def resource() -> str:
    """A resource name no other test uses."""
    return f"prn:test.repository:{uuid.uuid4()}"
