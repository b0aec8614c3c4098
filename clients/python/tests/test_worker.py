"""The Python worker against a real broker on throwaway PostgreSQL and Redis."""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator

import grpc
import psycopg
import pytest

from conftest import REPO, Db, Sandbox, start_sandbox, stop_sandbox
from dispatch_broker_client import (
    BrokerError,
    CancelRequested,
    LeaseReopened,
    RetryPolicy,
    TaskLost,
    Worker,
)
from dispatch_broker_client._proto import broker_pb2 as pb
from dispatch_broker_client._proto import broker_pb2_grpc as pb_grpc

LONG = 20.0


def worker(sandbox: Sandbox, name: str = "py-worker", **kw: object) -> Worker:
    kw.setdefault("ttl", 0.9)
    return Worker(sandbox.address, name, **kw)  # type: ignore[arg-type]


def next_event(w: Worker, kind: type) -> object:
    deadline = time.monotonic() + LONG
    while time.monotonic() < deadline:
        event = w.events.get(timeout=LONG)
        if isinstance(event, kind):
            return event
    raise AssertionError(f"no {kind.__name__} event")


def test_grants_oldest_first_and_finish_or_release_frees_the_locks(sandbox: Sandbox, db: Db, resource: str) -> None:
    first = db.task(resource, "shared:prn:core.domain:d")
    second = db.task(resource)
    with worker(sandbox) as w:
        task = w.fetch()
        assert task is not None and task.task_id == first
        assert task.fencing_token > 0
        assert task.exclusive_resources == [resource]
        assert w.fetch() is None, "the second task waits behind the first"
        task.start()
        assert db.state(first) == "running"
        assert task.finish("completed") == "completed"
        assert db.state(first) == "completed"

        # Pulp-style: the worker records the state itself and only releases the locks.
        task = w.fetch()
        assert task is not None and task.task_id == second
        db.conn.execute("UPDATE core_task SET state = 'completed' WHERE pulp_id = %s", (second,))
        assert task.release() is True


def test_a_long_poll_receives_a_task_inserted_while_it_waits(sandbox: Sandbox, db: Db, resource: str) -> None:
    inserted: list[str] = []
    timer = threading.Timer(0.3, lambda: inserted.append(db.task(resource)))
    with worker(sandbox) as w:
        timer.start()
        task = w.fetch(wait=LONG)
        assert task is not None, "a task arrived before the wait ran out"
        assert task.task_id == inserted[0]
        task.release()


def test_a_cancel_reaches_the_holder_through_its_heartbeat(sandbox: Sandbox, db: Db, resource: str) -> None:
    task_id = db.task(resource)
    with worker(sandbox, "holder") as holder, worker(sandbox, "other") as other:
        task = holder.fetch()
        assert task is not None
        task.start()
        assert not task.cancelled.is_set()
        answer = other.cancel(task_id)
        assert answer.state == "canceling" and answer.holder_notified
        assert task.cancelled.wait(LONG), "the heartbeat reply set the cancel event"
        event = next_event(holder, CancelRequested)
        assert isinstance(event, CancelRequested) and event.task_id == task_id
        assert not task.lost
        assert task.finish("canceled") == "canceled"


def test_a_lease_ended_elsewhere_is_replaced_and_its_tasks_reported_lost(sandbox: Sandbox, db: Db, resource: str) -> None:
    task_id = db.task(resource)
    with worker(sandbox) as w:
        task = w.fetch()
        assert task is not None
        task.start()
        old = w.lease_id
        # The lease ends behind the worker's back (as when the sweeper expires it).
        with grpc.insecure_channel(sandbox.address) as channel:
            pb_grpc.BrokerStub(channel).CloseLease(pb.CloseLeaseRequest(lease_id=old), timeout=10)
        event = next_event(w, LeaseReopened)
        assert isinstance(event, LeaseReopened)
        assert event.old_lease_id == old and event.new_lease_id == w.lease_id != old
        assert event.lost_tasks == [task_id] and event.adopted_tasks == []
        assert task.lost and task.cancelled.is_set()
        assert db.state(task_id) == "failed", "closing the lease failed the running task"
        with pytest.raises(TaskLost):
            task.finish("completed")
        assert db.state(task_id) == "failed"
        # The new lease works.
        fresh = db.task(resource)
        task = w.fetch()
        assert task is not None and task.task_id == fresh
        task.release()


def test_a_fetch_that_starts_its_task_needs_no_start_call(sandbox: Sandbox, db: Db, resource: str) -> None:
    task_id = db.task(resource)
    with worker(sandbox) as w:
        task = w.fetch(start=True)
        assert task is not None and task.task_id == task_id
        assert task.started_at is not None and task.started_at.tzinfo is not None
        assert db.state(task_id) == "running"
        task.start()  # nothing left to do: no call, no error
        assert task.finish("completed") == "completed"
        assert db.state(task_id) == "completed"


def test_leaving_a_task_block_without_finish_releases_it(sandbox: Sandbox, db: Db, resource: str) -> None:
    task_id = db.task(resource)
    with worker(sandbox, "first") as first, worker(sandbox, "second") as second:
        with first.fetch() as task:  # type: ignore[union-attr]
            assert task.task_id == task_id
            assert second.fetch() is None, "held by the first worker"
        again = second.fetch()
        assert again is not None and again.task_id == task_id, "released and back in the queue"
        again.release()


def test_an_exception_in_a_running_tasks_block_fails_the_task(sandbox: Sandbox, db: Db, resource: str) -> None:
    task_id = db.task(resource)
    with worker(sandbox) as w:
        with pytest.raises(RuntimeError, match="boom"):
            with w.fetch() as task:  # type: ignore[union-attr]
                task.start()
                raise RuntimeError("boom")
        assert db.state(task_id) == "failed"
        assert w.fetch() is None


def test_errors_name_the_call_the_status_and_the_message(sandbox: Sandbox, db: Db) -> None:
    with worker(sandbox) as w:
        with pytest.raises(BrokerError) as bad:
            w.cancel("not-a-uuid")
        assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert str(bad.value).startswith("CancelTask failed: INVALID_ARGUMENT: ")
        with pytest.raises(BrokerError) as missing:
            w.claim("00000000-0000-4000-8000-000000000000")
        assert missing.value.code == grpc.StatusCode.NOT_FOUND
        assert missing.value.not_found == "task" and not missing.value.is_lease_not_found
    with pytest.raises(BrokerError) as ttl:
        Worker(sandbox.address, "w", ttl=0.001).open()
    assert ttl.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "ttl" in ttl.value.message


WORKER_SCRIPT = """
import sys, time
sys.path.insert(0, {client!r})
from dispatch_broker_client import Worker

w = Worker({address!r}, "sigterm-worker", ttl=0.9).open()
w.install_signal_handlers()

def handle(task):
    task.start()
    print("started", task.task_id, flush=True)
    time.sleep(1.0)
    task.finish("completed")

print("handled", w.run(handle, wait=1.0), flush=True)
"""


def test_sigterm_lets_the_running_task_finish_and_closes_the_lease(sandbox: Sandbox, db: Db, resource: str) -> None:
    first = db.task(resource)
    second = db.task(resource + "-b")
    script = WORKER_SCRIPT.format(client=str(REPO / "clients" / "python"), address=sandbox.address)
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    started = process.stdout.readline().split()
    assert started == ["started", first]
    process.send_signal(signal.SIGTERM)
    out, _ = process.communicate(timeout=LONG)
    assert process.returncode == 0
    assert out.split() == ["handled", "1"]
    assert db.state(first) == "completed", "it finished after SIGTERM"
    assert db.state(second) == "waiting" and db.app_lock(second) is None, "nothing fetched after SIGTERM"


def test_open_waits_for_a_broker_that_is_still_starting() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    w = Worker(f"127.0.0.1:{port}", "early", ttl=0.9)
    opened: list[object] = []
    thread = threading.Thread(target=lambda: opened.append(w.open()))
    thread.start()
    time.sleep(0.3)
    box = start_sandbox("--listen", f"127.0.0.1:{port}")
    try:
        thread.join(LONG)
        assert opened == [w], "open retried until the broker answered"
        assert w.lease_id
        w.close()
    finally:
        stop_sandbox(box)


def test_a_broker_with_a_token_rejects_calls_without_it(tmp_path: pathlib.Path) -> None:
    token = tmp_path / "token"
    token.write_text("py-secret\n")
    box = start_sandbox("--auth-token-file", str(token))
    try:
        with pytest.raises(BrokerError) as rejected:
            Worker(box.address, "no-token", ttl=0.9).open()
        assert rejected.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert "bearer token" in rejected.value.message
        with Worker(box.address, "with-token", ttl=0.9, token="py-secret") as w:
            assert w.fetch() is None
    finally:
        stop_sandbox(box)


def test_retry_policy_backs_off_within_its_budget() -> None:
    p = RetryPolicy(initial=0.1, maximum=1.0, max_elapsed=2.5)
    assert p.delay(0, 0.0, 0.0) == pytest.approx(0.05)
    assert 0.1 <= p.delay(1, 0.0, 0.5) <= 0.2  # type: ignore[operator]
    assert p.delay(10, 0.0, 0.999) <= 1.0  # type: ignore[operator]
    assert p.delay(9, 2.4, 0.999) == pytest.approx(0.1)
    assert p.delay(9, 2.5, 0.5) is None


def test_a_call_that_never_gets_an_answer_gives_up_within_the_retry_budget() -> None:
    # The retry budget counts from the first try, the tries included: against an address that
    # takes connections and never answers, every OpenLease try waits for its deadline, and opening
    # gives up within the budget and one try (counting only the waits, at least 3.5 s here).
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        port = silent.getsockname()[1]
        w = Worker(f"127.0.0.1:{port}", "unanswered", call_timeout=0.5,
                   retry=RetryPolicy(initial=0.1, maximum=5.0, max_elapsed=1.0))
        began = time.monotonic()
        with pytest.raises(BrokerError) as gave_up:
            w.open()
        took = time.monotonic() - began
        w.close()
    assert gave_up.value.code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
    assert took < 2.8, f"gave up after {took:.2f} s: the 1 s budget and one 0.5 s try are about 1.5 s"


def test_committed_stubs_match_the_proto() -> None:
    gen = pathlib.Path(__file__).resolve().parents[1] / "gen_stubs.py"
    result = subprocess.run([sys.executable, str(gen), "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_a_grant_that_never_arrived_is_handed_back_and_runs_elsewhere(sandbox: Sandbox, db: Db, resource: str) -> None:
    task_id = db.task(resource)
    with worker(sandbox) as w, worker(sandbox, "other") as other:
        # A FetchTask under the worker's lease whose answer the worker never sees (as when the
        # replica that made the grant is killed before answering).
        with grpc.insecure_channel(sandbox.address) as channel:
            lost = pb_grpc.BrokerStub(channel).FetchTask(
                pb.FetchTaskRequest(lease_id=w.lease_id, start=True), timeout=10)
        assert lost.task.task_id == task_id
        deadline = time.monotonic() + LONG
        while db.state(task_id) != "waiting" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert db.state(task_id) == "waiting", "the heartbeats handed the grant back"
        assert db.app_lock(task_id) is None
        again = other.fetch(wait=5.0)
        assert again is not None and again.task_id == task_id
        assert again.finish("completed") == "completed"


def test_a_task_the_worker_holds_is_never_handed_back(sandbox: Sandbox, db: Db, resource: str) -> None:
    task_id = db.task(resource)
    with worker(sandbox) as w:
        task = w.fetch(start=True)
        assert task is not None and task.task_id == task_id
        time.sleep(3.0)  # ten heartbeats (every 0.3 s) list it
        assert db.state(task_id) == "running"
        assert task.finish("completed") == "completed"


def _app_status(db: Db, name: str) -> str:
    row_id = str(uuid.uuid4())
    db.conn.execute(
        "INSERT INTO core_appstatus (pulp_id, pulp_created, pulp_last_updated, app_type, name, versions, ttl, "
        "last_heartbeat) VALUES (%s, now(), now(), 'worker', %s, ''::hstore, interval '30 seconds', now())",
        (row_id, name),
    )
    return row_id


def _close_unless_ended(sandbox: Sandbox, lease_id: str) -> None:
    """CloseLease, unless the broker ended the lease itself already (a heartbeat's write found its
    row gone)."""
    with grpc.insecure_channel(sandbox.address) as channel:
        try:
            pb_grpc.BrokerStub(channel).CloseLease(pb.CloseLeaseRequest(lease_id=lease_id), timeout=10)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.NOT_FOUND, e


def test_a_worker_whose_own_row_is_gone_reopens_with_the_row_it_is_given(sandbox: Sandbox, db: Db, resource: str) -> None:
    own = _app_status(db, "own-row")
    replacements: list[str] = []

    def replace() -> str:
        replacements.append(_app_status(db, "own-row"))
        return replacements[-1]

    with worker(sandbox, "own-row", app_status_id=own, replace_app_status=replace) as w:
        assert w.app_status_id == own
        old = w.lease_id
        # Pulp's clean-up deletes the row, and the lease ends.
        db.conn.execute("DELETE FROM core_appstatus WHERE pulp_id = %s", (own,))
        _close_unless_ended(sandbox, old)
        task_id = db.task(resource)
        task = w.fetch()
        assert task is not None and task.task_id == task_id
        assert len(replacements) == 1 and w.app_status_id == replacements[0] and w.lease_id != old
        assert db.app_lock(task_id) == replacements[0]
        task.release()


def test_without_a_replacement_a_worker_whose_own_row_is_gone_cannot_reopen(sandbox: Sandbox, db: Db) -> None:
    own = _app_status(db, "own-row-2")
    with worker(sandbox, "own-row-2", app_status_id=own) as w:
        db.conn.execute("DELETE FROM core_appstatus WHERE pulp_id = %s", (own,))
        _close_unless_ended(sandbox, w.lease_id)
        with pytest.raises(BrokerError) as raised:
            w.fetch()
        assert raised.value.code == grpc.StatusCode.NOT_FOUND and raised.value.not_found == "app-status"


def _redis(redis_url: str, *command: str) -> bytes:
    """Sends one command to the sandbox's Redis (no password or TLS); returns the first bytes of
    its reply."""
    address = redis_url.split("://", 1)[1].split("/", 1)[0]
    host, port = address.rsplit(":", 1)
    request = f"*{len(command)}\r\n" + "".join(f"${len(part)}\r\n{part}\r\n" for part in command)
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(request.encode())
        return conn.recv(65536)


def _flush_redis(redis_url: str) -> None:
    """Empties Redis (FLUSHALL) as a restart without persistence would: the broker finds its lock
    state lost at the next call and rebuilds it from Postgres."""
    assert _redis(redis_url, "FLUSHALL").startswith(b"+OK"), "FLUSHALL"


def _redis_pid(redis_url: str) -> int:
    """The process id of the sandbox's Redis (from INFO), to freeze it with SIGSTOP."""
    for line in _redis(redis_url, "INFO", "server").decode().splitlines():
        if line.startswith("process_id:"):
            return int(line.split(":", 1)[1])
    raise AssertionError("INFO server named no process_id")


def _until_a_session_waits_on_a_lock(db: Db, what: str) -> None:
    """Waits until a session of the test's database waits on a lock (the call under test reached
    the row or table another transaction holds); fails with ``what`` after LONG."""
    deadline = time.monotonic() + LONG
    while db.conn.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
    ).fetchone() == (0,):
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


@contextlib.contextmanager
def _rebuilt_worker(resource: str) -> Iterator[tuple[Db, str, Worker, Sandbox]]:
    """A broker of its own (the test empties its Redis), a waiting task on ``resource``, and a
    worker with its own core_appstatus row and a TTL long enough that no heartbeat reopens its
    lease while the test runs: yields the database, the task, the worker and the sandbox."""
    box = start_sandbox()
    own = Db(box.postgres_url)
    try:
        task_id = own.task(resource)
        row = _app_status(own, "py-rebuilt")
        with worker(box, "py-rebuilt", ttl=30.0, app_status_id=row) as w:
            yield own, task_id, w, box
    finally:
        own.conn.close()
        stop_sandbox(box)


def test_a_finish_made_while_redis_lost_its_state_goes_through_under_the_adopted_token(resource: str) -> None:
    with _rebuilt_worker(resource) as (own, task_id, w, box):
        task = w.fetch()
        assert task is not None
        task.start()
        token = task.fencing_token
        _flush_redis(box.redis_url)
        assert task.finish("completed") == "completed"
        assert task.fencing_token > token, "finished under the token the rebuilt lease gave"
        assert own.state(task_id) == "completed"
        event = next_event(w, LeaseReopened)
        assert isinstance(event, LeaseReopened) and event.adopted_tasks == [task_id]


def test_a_finish_after_the_lease_ended_elsewhere_reports_the_task_lost(sandbox: Sandbox, db: Db, resource: str) -> None:
    task_id = db.task(resource)
    with worker(sandbox, ttl=30.0) as w:
        task = w.fetch()
        assert task is not None
        task.start()
        # The lease ends behind the worker's back before its heartbeat notices.
        with grpc.insecure_channel(sandbox.address) as channel:
            pb_grpc.BrokerStub(channel).CloseLease(pb.CloseLeaseRequest(lease_id=w.lease_id), timeout=10)
        with pytest.raises(TaskLost):
            task.finish("completed")
        assert db.state(task_id) == "failed", "closing the lease failed it"


def test_a_release_made_while_redis_lost_its_state_goes_through_under_the_adopted_token(resource: str) -> None:
    with _rebuilt_worker(resource) as (own, task_id, w, box):
        # Claimed, never started: the rebuild locks it again for the worker's row.
        task = w.fetch()
        assert task is not None
        _flush_redis(box.redis_url)
        assert task.release(), "released under the token the rebuilt lease gave"
        assert own.state(task_id) == "waiting" and own.app_lock(task_id) is None, "back in the queue"
        event = next_event(w, LeaseReopened)
        assert isinstance(event, LeaseReopened) and event.adopted_tasks == [task_id]


def test_stop_ends_a_long_poll_at_once(sandbox: Sandbox, db: Db, resource: str) -> None:
    with worker(sandbox, ttl=30.0) as w:
        got: list[object] = []
        poll = threading.Thread(target=lambda: got.append(w.fetch(wait=30.0)))
        poll.start()
        time.sleep(0.5)  # the call is under way, with nothing to hand out
        w.stop()
        poll.join(timeout=10.0)
        assert not poll.is_alive(), "stop() did not end the long poll"
        assert got == [None]
        # Nothing was left held by the given-up call: a task inserted now stays waiting.
        task_id = db.task(resource)
        assert db.app_lock(task_id) is None


def test_a_finish_without_an_answer_is_retried_in_the_background_under_the_token_a_rebuild_gave(
    resource: str,
) -> None:
    with _rebuilt_worker(resource) as (own, task_id, w, box):
        task = w.fetch()
        assert task is not None
        task.start()
        token = task.fencing_token
        _flush_redis(box.redis_url)
        # A fetch meets the lease the broker no longer knows: the new lease adopts the task.
        assert w.fetch() is None
        assert task.fencing_token > token
        # The finish gets no answer in time: DEADLINE_EXCEEDED from the client, or CANCELLED
        # ("Timeout expired") when the deadline passed at the broker first. Either way it is
        # retried in the background, under the new token. (Rarely a try gets its answer within
        # so short a deadline: the finish then went through at once, under the new token too.)
        w.call_timeout = 0.0001
        try:
            task.finish("completed")
        except BrokerError as failed:
            assert failed.code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED), failed
        w.call_timeout = 10.0
        deadline = time.monotonic() + LONG
        while own.state(task_id) != "completed" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert own.state(task_id) == "completed", "the background retry recorded the outcome"


def test_a_reopen_whose_answer_was_lost_still_gets_the_adopted_task(resource: str) -> None:
    """The reopen after a Redis loss gets no answer in time (the broker adopted the task into the
    new lease, the worker gave up waiting): it is retried with the same open id, gets that lease
    and the task, and the finish goes through. Without the open id the retry opened a second
    lease that adopted nothing, and the task was reported lost."""
    with _rebuilt_worker(resource) as (own, task_id, w, box):
        task = w.fetch()
        assert task is not None
        task.start()
        _flush_redis(box.redis_url)
        # The broker rebuilds the task's locks for the worker's row (seen by a call of its own).
        with grpc.insecure_channel(box.address) as channel:
            stub = pb_grpc.BrokerStub(channel)
            deadline = time.monotonic() + LONG
            while True:
                try:
                    stub.FetchTask(pb.FetchTaskRequest(lease_id=w.lease_id), timeout=10)
                except grpc.RpcError as e:
                    if e.code() == grpc.StatusCode.NOT_FOUND:
                        break
                assert time.monotonic() < deadline, "the locks were not rebuilt"
                time.sleep(0.05)
        # The worker's reopen is held in Postgres (its row is checked first) ...
        blocker = psycopg.connect(box.postgres_url)
        blocker.execute("LOCK TABLE core_appstatus IN ACCESS EXCLUSIVE MODE")
        w.call_timeout = 1.0
        outcome: list[object] = []
        finishing = threading.Thread(target=lambda: outcome.append(task.finish("completed")))
        finishing.start()
        _until_a_session_waits_on_a_lock(own, "the reopen did not reach Postgres")
        # ... then reaches a Redis that answers only after the worker gave up on the call: the
        # lease is opened and adopts the task, and the answer goes nowhere. (Frozen, not paused
        # with CLIENT PAUSE: a paused server drops the command of a connection that closed.)
        redis_pid = _redis_pid(box.redis_url)
        os.kill(redis_pid, signal.SIGSTOP)
        try:
            blocker.rollback()
            blocker.close()
            time.sleep(1.5)
        finally:
            os.kill(redis_pid, signal.SIGCONT)
        finishing.join(timeout=LONG)
        assert outcome == ["completed"], "the finish went through"
        assert own.state(task_id) == "completed"
        event = next_event(w, LeaseReopened)
        assert isinstance(event, LeaseReopened) and event.adopted_tasks == [task_id]


def test_a_start_whose_answer_was_lost_is_made_again_and_the_task_runs(sandbox: Sandbox, db: Db, resource: str) -> None:
    """The task's row is held by another transaction for longer than the start's deadline (the
    start goes through once it is free): the library makes the call again, the broker answers it
    with the time the task started, and the task runs and finishes."""
    task_id = db.task(resource)
    with worker(sandbox, ttl=30.0, call_timeout=0.5) as w:
        task = w.fetch()
        assert task is not None
        blocker = psycopg.connect(sandbox.postgres_url)
        blocker.execute("SELECT 1 FROM core_task WHERE pulp_id = %s FOR UPDATE", (task_id,))
        outcome: list[object] = []
        starting = threading.Thread(target=lambda: outcome.append(task.start()))
        starting.start()
        _until_a_session_waits_on_a_lock(db, "the start did not reach the task's row")
        time.sleep(0.8)  # past the first call's deadline: the library made the call again
        blocker.rollback()
        blocker.close()
        starting.join(timeout=LONG)
        assert outcome == [None], "the start went through"
        assert db.state(task_id) == "running"
        assert task.finish("completed") == "completed"
        assert db.state(task_id) == "completed"
