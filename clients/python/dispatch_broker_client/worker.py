"""A dispatch-broker worker: lease, heartbeats, fetch, cancellation, clean shutdown.

The same behaviour as the Rust library ``dispatch_worker`` (clients/rust):

* ``Worker`` opens a lease on ``open()`` (or entering ``with``) and heartbeats every TTL/3,
  jittered, in a daemon thread.
* ``fetch(wait=...)`` long-polls FetchTask and returns a ``Task`` (or ``None``); a task's
  ``cancelled`` event is set when a heartbeat reply asks for it to be canceled, or when it is lost.
* When the broker answers NOT_FOUND for the lease, the worker opens a new one under the same
  ``core_appstatus`` row if it still exists, keeps the tasks the broker hands back (new fencing
  tokens) and reports every other held task lost (``Task.lost``, ``cancelled`` set, a
  ``LeaseReopened`` event); a lost task's ``start``/``finish``/``release`` raise ``TaskLost``.
* Every call has a deadline; UNAVAILABLE and RESOURCE_EXHAUSTED are retried with jittered
  exponential backoff, no other status is. Failures raise ``BrokerError`` naming the call, the status and the broker's message.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import queue
import random
import signal
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import timezone
from types import TracebackType
from typing import Any, TypeVar

import grpc
from google.protobuf import duration_pb2

from ._proto import broker_pb2 as pb
from ._proto import broker_pb2_grpc as pb_grpc

log = logging.getLogger("dispatch_broker_client")

NOT_FOUND_KEY = "dispatch-not-found"
# Failures after which a call may still succeed later (unreachable, or the answer was lost).
# CANCELLED too: this library never cancels a finish or release itself, and the broker answers
# CANCELLED ("Timeout expired") when the call's deadline passed there before it answered.
TRANSIENT = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
)
# Retried with backoff: unreachable, or a limit of the broker (it did nothing; back off).
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
# Retried for a call that may be made again when its answer was lost (OpenLease, which carries an
# open id; StartTask, which the broker answers alike when the start was made): RETRYABLE, and no
# answer in time (the broker answers CANCELLED, "Timeout expired", when the deadline passed there).
REPEATABLE = RETRYABLE + (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
FINAL_STATES = ("completed", "failed", "canceled", "skipped")

T = TypeVar("T")


class BrokerError(Exception):
    """The broker answered an RPC with an error status (after retries, for UNAVAILABLE)."""

    def __init__(self, method: str, code: grpc.StatusCode, message: str, not_found: str | None = None):
        super().__init__(f"{method} failed: {code.name}: {message}")
        self.method = method
        self.code = code
        self.message = message
        #: For NOT_FOUND: what was not found ("lease", "task" or "app-status").
        self.not_found = not_found

    @property
    def is_lease_not_found(self) -> bool:
        """True when the broker no longer knows the lease (expired, closed, or state lost)."""
        return self.code == grpc.StatusCode.NOT_FOUND and self.not_found == "lease"

    @property
    def is_app_status_not_found(self) -> bool:
        """True when the ``core_appstatus`` row named in OpenLease does not exist."""
        return self.code == grpc.StatusCode.NOT_FOUND and self.not_found == "app-status"


class TaskLost(Exception):
    """The task is no longer this worker's: its lease ended and no new lease took it over."""

    def __init__(self, task_id: str):
        super().__init__(f"task {task_id} is lost: the lease that held it ended; do not record its results")
        self.task_id = task_id


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """Backoff for UNAVAILABLE: the n-th retry waits between half and all of ``initial * 2**n``
    (at most ``maximum``) seconds, until ``max_elapsed`` seconds have passed since the first try:
    the tries count, not only the waits (a try that waits for its deadline takes
    ``call_timeout``), so a call gives up within ``max_elapsed`` and one try."""

    initial: float = 0.1
    maximum: float = 5.0
    max_elapsed: float = 60.0

    def delay(self, attempt: int, elapsed: float, jitter: float) -> float | None:
        """The wait before retry ``attempt`` (0-based), ``elapsed`` seconds after the first try
        began, or None when the budget is spent."""
        step: float = min(self.initial * float(2 ** min(attempt, 20)), self.maximum)
        left = self.max_elapsed - elapsed
        if left <= 0:
            return None
        return min(step / 2 + step * min(max(jitter, 0.0), 1.0) / 2, left)


@dataclasses.dataclass(frozen=True)
class TlsConfig:
    """TLS to a broker serving it (``--tls-cert``), like the Rust client's ``WorkerConfig.tls``.

    ``ca``: the PEM bundle the broker's certificate must chain to (None: the system's roots).
    ``domain``: the name that certificate must carry (None: the host of the target), for a broker
    reached by an address its certificate does not name. ``cert`` and ``key``: the client
    certificate chain and its private key (PEM), which a broker with ``--tls-client-ca`` requires
    (mutual TLS)."""

    ca: bytes | None = None
    domain: str | None = None
    cert: bytes | None = None
    key: bytes | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("a client certificate needs its private key: give both cert and key, or neither")

    @classmethod
    def from_files(
        cls,
        ca: str | os.PathLike[str] | None = None,
        domain: str | None = None,
        cert: str | os.PathLike[str] | None = None,
        key: str | os.PathLike[str] | None = None,
    ) -> TlsConfig:
        """The same, read from PEM files; ValueError names a file that cannot be read."""
        return cls(
            ca=_read_pem(ca, "ca"), domain=domain or None, cert=_read_pem(cert, "cert"), key=_read_pem(key, "key")
        )

    def credentials(self) -> grpc.ChannelCredentials:
        """The gRPC channel credentials."""
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )

    def channel_options(self) -> list[tuple[str, str]]:
        """Channel options: the name the broker's certificate is checked against, when given."""
        return [("grpc.ssl_target_name_override", self.domain)] if self.domain else []


def _read_pem(path: str | os.PathLike[str] | None, what: str) -> bytes | None:
    if path is None or str(path) == "":
        return None
    try:
        return pathlib.Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read the TLS {what} file {path}: {e.strerror}") from None


@dataclasses.dataclass(frozen=True)
class LeaseReopened:
    """The broker no longer knew the lease; a new one replaced it."""

    old_lease_id: str
    new_lease_id: str
    adopted_tasks: list[str]
    lost_tasks: list[str]


@dataclasses.dataclass(frozen=True)
class CancelRequested:
    """A heartbeat reply asked for this held task to be canceled."""

    task_id: str


@dataclasses.dataclass(frozen=True)
class HeartbeatFailed:
    """A heartbeat failed; the lease lives until its TTL runs out."""

    error: str


WorkerEvent = LeaseReopened | CancelRequested | HeartbeatFailed


@dataclasses.dataclass(frozen=True)
class CancelResult:
    """What CancelTask did."""

    state: str
    holder_notified: bool


class Task:
    """A task this worker holds: its locks stay held until ``finish`` or ``release`` (or the end of
    a ``with`` block, which releases them if neither was called)."""

    def __init__(self, worker: Worker, message: pb.Task):
        self._worker = worker
        self.task_id: str = message.task_id
        self.name: str = message.name
        self.exclusive_resources: list[str] = list(message.exclusive_resources)
        self.shared_resources: list[str] = list(message.shared_resources)
        self.immediate: bool = message.immediate
        #: Set when a heartbeat reply asks for the task to be canceled, or when it is lost.
        self.cancelled = threading.Event()
        self._token = message.fencing_token
        self._lost = False
        self._done = False
        #: Set when the grant started the task (``fetch(start=True)``); start() then makes no call.
        self.started_at = message.started_at.ToDatetime(tzinfo=timezone.utc) if message.HasField("started_at") else None
        self._started = self.started_at is not None

    def __repr__(self) -> str:
        return f"Task({self.task_id!r}, name={self.name!r}, fencing_token={self._token}, lost={self._lost})"

    @property
    def fencing_token(self) -> int:
        """The fencing token of this grant (a new one when a reopened lease adopted the task)."""
        return self._token

    @property
    def lost(self) -> bool:
        """True when the task is no longer this worker's; stop working on it."""
        return self._lost

    def _check(self) -> None:
        if self._lost:
            raise TaskLost(self.task_id)

    def start(self) -> None:
        """Marks the task running through the broker (StartTask); nothing to do for a task whose
        grant started it."""
        self._check()
        if self.started_at is not None:
            return
        # Also retried when no answer came: the broker answers a start its holder already made
        # with the time it started.
        self._worker._with_lease(
            "StartTask",
            lambda stub, lease_id, timeout: stub.StartTask(
                pb.StartTaskRequest(lease_id=lease_id, task_id=self.task_id, fencing_token=self._token),
                timeout=timeout,
            ),
            check=self._check,
            retried=REPEATABLE,
        )
        self._started = True

    def finish(self, state: str = "completed", error: str | None = None) -> str:
        """Records the final state (``error`` for a failure) and releases the locks; returns the
        state the task has now."""
        if state not in FINAL_STATES:
            raise ValueError(f"state must be one of {', '.join(FINAL_STATES)}, not {state!r}")
        self._check()
        self._done = True
        reply = self._worker._let_go(
            "FinishTask",
            self,
            lambda stub, lease_id, timeout: stub.FinishTask(
                pb.FinishTaskRequest(
                    lease_id=lease_id,
                    task_id=self.task_id,
                    fencing_token=self._token,
                    state=state,
                    error=error or "",
                ),
                timeout=timeout,
            ),
        )
        return str(reply.state)

    def release(self) -> bool:
        """Releases the task's locks (for workers that record task state themselves, as Pulp's
        do). Returns False when they were already released."""
        self._check()
        self._done = True
        reply = self._worker._let_go(
            "ReleaseLocks",
            self,
            lambda stub, lease_id, timeout: stub.ReleaseLocks(
                pb.ReleaseLocksRequest(lease_id=lease_id, task_id=self.task_id, fencing_token=self._token),
                timeout=timeout,
            ),
        )
        return bool(reply.released)

    def __enter__(self) -> Task:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self._done and not self._lost:
            if self._started:
                # The broker keeps a running task's locks until its final state is recorded.
                log.warning("running task %s left its block without finish; failing it", self.task_id)
                reason = f"{exc_type.__name__}: {exc}" if exc_type is not None else "left its block without finish"
                self.finish("failed", error=reason)
            else:
                log.warning("task %s left its block without finish or release; releasing its locks", self.task_id)
                self.release()


#: How long a handed-back grant is remembered, so that its answer, if it arrives after all, is not
#: run (an answer is never delayed anywhere near this long).
_HANDED_BACK_FOR = 3600.0

#: Most grants handed back by one heartbeat (the broker refuses more than ``--max-skip-ids``,
#: 1,000 by default); the rest go with the next ones.
_HAND_BACK_AT_ONCE = 100


class _Undelivered:
    """Grants the broker made for this worker that never arrived (the answer was lost with a
    replica or a connection): the lease holds them, so nothing else may run them, and nobody here
    runs them. A task the heartbeats list as held that this worker never received, in two
    heartbeats in a row (an answer on its way arrives well within a heartbeat's period), is one:
    the next heartbeat hands it back (``HeartbeatRequest.undelivered``), and the following ones do
    again while the heartbeats still list it (the broker acts once, and only on the grant under
    its token: it requeues the task, then releases its locks). Once a grant is handed back, an answer bringing it
    after all is not run; one that arrives before that takes it off the list. Not thread-safe:
    the worker calls it under its lock."""

    def __init__(self) -> None:
        #: Grants received (task, fencing token) -> when: kept while a heartbeat lists them, and
        #: until one sent after they arrived.
        self.received: dict[tuple[str, int], float] = {}
        #: Listed and never received at the last heartbeat -> (token, lease generation).
        self.suspects: dict[str, tuple[int, int]] = {}
        #: To hand back with the next heartbeat: (task, token, lease generation).
        self.due: list[tuple[str, int, int]] = []
        #: Handed back (or being handed back): task -> (token, when).
        self.handed_back: dict[str, tuple[int, float]] = {}

    def note_received(self, task_id: str, token: int) -> bool:
        """Notes a grant that arrived; False when it was handed back already (it must not run)."""
        now = time.monotonic()
        self.handed_back = {k: v for k, v in self.handed_back.items() if now - v[1] < _HANDED_BACK_FOR}
        back = self.handed_back.get(task_id)
        if back is not None and back[0] == token:
            return False
        # Arrived late but before its hand-back: it is this worker's after all.
        self.suspects.pop(task_id, None)
        self.due = [d for d in self.due if d[0] != task_id]
        self.received[(task_id, token)] = now
        return True

    def listed(self, held: Sequence[pb.HeldTask], generation: int, sent: float) -> None:
        """What a heartbeat sent at ``sent`` (``time.monotonic()``) listed as held under the lease
        of ``generation``."""
        listed = {(h.task_id, h.fencing_token) for h in held}
        # A grant received before the heartbeat was sent and not listed was let go.
        self.received = {k: at for k, at in self.received.items() if at >= sent or k in listed}
        suspects: dict[str, tuple[int, int]] = {}
        for h in held:
            if (h.task_id, h.fencing_token) in self.received:
                continue
            back = self.handed_back.get(h.task_id)
            handed_back = back is not None and back[0] == h.fencing_token
            twice = self.suspects.get(h.task_id) == (h.fencing_token, generation)
            if handed_back or twice:
                if not any(d[0] == h.task_id for d in self.due):
                    self.due.append((h.task_id, h.fencing_token, generation))
            else:
                suspects[h.task_id] = (h.fencing_token, generation)
        self.suspects = suspects

    def due_now(self, generation: int) -> list[pb.HeldTask]:
        """The grants to hand back with a heartbeat of the lease of ``generation``; from now on an
        answer bringing one of them is not run."""
        self.due = [d for d in self.due if d[2] == generation]
        now = time.monotonic()
        out = self.due[:_HAND_BACK_AT_ONCE]
        for task_id, token, _ in out:
            self.handed_back[task_id] = (token, now)
        return [pb.HeldTask(task_id=task_id, fencing_token=token) for task_id, token, _ in out]

    def reported(self, handed_back: Sequence[pb.HeldTask]) -> None:
        """The broker has these (it acts on them after answering)."""
        back = {h.task_id for h in handed_back}
        self.due = [d for d in self.due if d[0] not in back]


class Worker:
    """One worker's lease on the broker at ``target`` (``host:port``; ``https://host:port`` means
    TLS with the system's roots unless ``tls`` says more). ``tls`` connects with TLS (and mutual
    TLS); ``credentials`` takes ready-made gRPC channel credentials instead.

    ``app_status_id`` is the worker's own ``core_appstatus`` row (the broker creates one per lease
    when it is unset). If that row is gone when the worker must open a new lease (Pulp's clean-up
    of missing processes deleted it), ``replace_app_status`` is called for the id of the row to
    use instead (a new one it created); without it, opening the new lease fails with NOT_FOUND
    (``app-status``)."""

    def __init__(
        self,
        target: str,
        name: str,
        *,
        versions: Mapping[str, str] | None = None,
        ttl: float = 30.0,
        token: str | None = None,
        app_status_id: str | None = None,
        replace_app_status: Callable[[], str] | None = None,
        call_timeout: float = 10.0,
        retry: RetryPolicy | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        tls: TlsConfig | None = None,
    ):
        if tls is not None and credentials is not None:
            raise ValueError("pass tls or credentials, not both")
        if target.startswith("https://"):
            target = target.removeprefix("https://")
            if tls is None and credentials is None:
                tls = TlsConfig()
        target = target.removeprefix("http://")
        self.name = name
        self.versions = dict(versions or {})
        self.ttl = ttl
        self.call_timeout = call_timeout
        self.retry = retry or RetryPolicy()
        self._configured_app_status = app_status_id
        self._replace_app_status = replace_app_status
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        if tls is not None:
            self._channel = grpc.secure_channel(target, tls.credentials(), options=tls.channel_options())
        elif credentials is not None:
            self._channel = grpc.secure_channel(target, credentials)
        else:
            self._channel = grpc.insecure_channel(target)
        self._stub = pb_grpc.BrokerStub(self._channel)  # type: ignore[no-untyped-call]
        self._lock = threading.Lock()
        self._reopening = threading.Lock()
        self._lease_id = ""
        self._app_status_id = app_status_id or ""
        self._lease_ttl = ttl
        self._generation = 0
        self._held: dict[str, Task] = {}
        #: Tasks being let go (finished or released, in the foreground or retried in the
        #: background): a reopened lease that adopts one gives it its new token.
        self._ending: list[Task] = []
        self._undelivered = _Undelivered()
        #: Set once shutdown began: fetch returns None from then on.
        self.stopping = threading.Event()
        #: One event per long poll under way: set when its answer arrives, or by ``stop``.
        self._polls: set[threading.Event] = set()
        self._closed = threading.Event()
        self._closing = threading.Event()
        #: LeaseReopened, CancelRequested and HeartbeatFailed, in order.
        self.events: queue.Queue[WorkerEvent] = queue.Queue()
        self._heartbeat: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------

    def open(self) -> Worker:
        """Opens the lease and starts heartbeating. Retries UNAVAILABLE (a broker still starting)."""
        self._install(self._open_lease(self._configured_app_status))
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="dispatch-heartbeat", daemon=True)
        self._heartbeat.start()
        return self

    def __enter__(self) -> Worker:
        return self.open()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def stop(self) -> None:
        """Stops fetching (a long poll under way ends at once, without a task); held tasks are
        unaffected until ``close``."""
        self.stopping.set()
        with self._lock:
            polls = list(self._polls)
        for woken in polls:
            woken.set()

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT stop fetching (call from the main thread). ``run`` then lets the
        running task finish and closes the lease."""

        def handler(signum: int, frame: Any) -> None:
            log.info("signal %s: stopping after the running task", signum)
            self.stop()

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def close(self) -> pb.CloseLeaseResponse:
        """Ends the lease: the broker releases its locks, requeues claimed tasks that did not start
        and fails those still running. Heartbeats stop."""
        self.stop()
        if self._closed.is_set():
            return pb.CloseLeaseResponse()
        self._closing.set()
        with self._reopening:  # a reopen under way finishes first: the lease closed is the last
            lease_id = self.lease_id
        reply: pb.CloseLeaseResponse
        try:
            if not lease_id:  # never opened (open() failed): there is nothing to close
                reply = pb.CloseLeaseResponse()
            else:
                reply = self._call(
                    "CloseLease",
                    lambda stub, timeout: stub.CloseLease(pb.CloseLeaseRequest(lease_id=lease_id), timeout=timeout),
                )
        except BrokerError as e:
            if not e.is_lease_not_found:
                raise
            reply = pb.CloseLeaseResponse()
        finally:
            self._closed.set()
            with self._lock:
                held, self._held = list(self._held.values()), {}
                held += self._ending
                self._ending = []
            for task in held:
                task._lost = True
                task.cancelled.set()
            self._channel.close()
        return reply

    # -- tasks -----------------------------------------------------------------------------

    @property
    def lease_id(self) -> str:
        """The lease in use now (it changes when the worker reopens one)."""
        with self._lock:
            return self._lease_id

    @property
    def app_status_id(self) -> str:
        """The core_appstatus row the lease claims tasks for."""
        with self._lock:
            return self._app_status_id

    def fetch(self, wait: float = 0.0, skip: Sequence[str] = (), start: bool = False) -> Task | None:
        """Waits up to ``wait`` seconds for the oldest ready task this worker may run, locked and
        claimed under its lease. None when nothing became ready, or when the worker is stopping.
        With ``start`` the grant also starts the task (one call instead of FetchTask and
        StartTask): it counts as running from then on, so if the lease ends before it is
        finished it is failed, not requeued."""
        if self.stopping.is_set():
            return None

        def long_poll(stub: _Authed, lease_id: str, timeout: float) -> pb.FetchTaskResponse:
            request = pb.FetchTaskRequest(
                lease_id=lease_id, wait=_duration(wait), skip_task_ids=list(skip), start=start
            )
            # Given up at ``stop``: the broker undoes a grant whose caller went away, so nothing
            # is left held (and one that arrived anyway is held by the lease, which ``close``
            # ends).
            call = stub.future("FetchTask", request, timeout)
            woken = threading.Event()
            with self._lock:
                self._polls.add(woken)
            try:
                call.add_done_callback(lambda _: woken.set())
                if self.stopping.is_set():
                    woken.set()
                woken.wait()
                if not call.done() and call.cancel():
                    return pb.FetchTaskResponse()
                reply: pb.FetchTaskResponse = call.result()
                return reply
            finally:
                with self._lock:
                    self._polls.discard(woken)

        reply, generation = self._with_lease("FetchTask", long_poll, wait=wait)  # type: ignore[arg-type]
        return self._grant(reply, generation)

    def claim(self, task_id: str) -> Task | None:
        """Immediate dispatch: locks and claims exactly this task if it is ready now."""
        reply, generation = self._with_lease(
            "ClaimTask",
            lambda stub, lease_id, timeout: stub.ClaimTask(
                pb.ClaimTaskRequest(lease_id=lease_id, task_id=task_id), timeout=timeout
            ),
        )
        return self._grant(reply, generation)

    def cancel(self, task_id: str) -> CancelResult:
        """Cancels any task: waiting -> canceled now; running -> its holder is told."""
        reply = self._call(
            "CancelTask",
            lambda stub, timeout: stub.CancelTask(pb.CancelTaskRequest(task_id=task_id), timeout=timeout),
        )
        return CancelResult(state=reply.state, holder_notified=reply.holder_notified)

    def run(self, handler: Callable[[Task], None], *, wait: float = 30.0, grace: float = 30.0) -> int:
        """Runs tasks one at a time with ``handler`` until ``stop()`` (e.g. by SIGTERM with
        ``install_signal_handlers``); then lets the running task finish, sets its ``cancelled``
        event if it runs longer than ``grace`` seconds after the stop, and closes the lease.
        The handler should ``finish`` (or ``release``) its task; one that does neither has the
        task released for it. The lease is closed once the handler returns. Returns the number of
        tasks handled."""
        handled = 0
        try:
            while not self.stopping.is_set():
                task = self.fetch(wait=wait)
                if task is None:
                    continue
                if self.stopping.is_set():
                    # Granted while shutdown began: back to the queue, not run.
                    if not task.lost:
                        task.release()
                    break
                handled += 1
                watchdog = threading.Thread(target=self._grace_watch, args=(task, grace), daemon=True)
                watchdog.start()
                try:
                    with task:
                        handler(task)
                except Exception:  # noqa: BLE001 - one task's failure must not stop the worker
                    log.exception("the handler failed on task %s; its locks were released", task.task_id)
        finally:
            self.close()
        return handled

    # -- internals -------------------------------------------------------------------------

    def _grace_watch(self, task: Task, grace: float) -> None:
        while not task._done and not task._lost:
            if self.stopping.wait(0.1):
                if not task.cancelled.wait(grace) and not task._done:
                    log.warning("task %s still runs %.1fs after shutdown began; asking it to stop", task.task_id, grace)
                    task.cancelled.set()
                return

    def _grant(self, reply: pb.FetchTaskResponse, generation: int) -> Task | None:
        """A task for a grant made under the lease of ``generation``: lost at once if the lease was
        replaced while the call was under way (the replacement could not have adopted it)."""
        if not reply.HasField("task"):
            return None
        task = Task(self, reply.task)
        with self._lock:
            if not self._undelivered.note_received(task.task_id, task.fencing_token):
                log.warning("a grant of task %s arrived after it was handed back as undelivered; it is not run here",
                            task.task_id)
                return None
            if self._generation == generation:
                self._held[task.task_id] = task
            else:
                log.warning("a grant of task %s arrived under a replaced lease; it is lost", task.task_id)
                task._lost = True
                task.cancelled.set()
        return task

    def _call(self, method: str, fn: Callable[[pb_grpc.BrokerStub, float], T], wait: float = 0.0,
              retry: RetryPolicy | None = None, retried: tuple[grpc.StatusCode, ...] = RETRYABLE) -> T:
        """One RPC with a deadline, retrying the codes ``retried`` (by default UNAVAILABLE and
        RESOURCE_EXHAUSTED) per the retry policy."""
        policy = retry or self.retry
        timeout = self.call_timeout + wait
        stub = _Authed(self._stub, self._metadata)
        attempt = 0
        # The budget counts from the first try: tries that wait for their deadline spend it too.
        began = time.monotonic()
        while True:
            try:
                return fn(stub, timeout)  # type: ignore[arg-type]
            except grpc.RpcError as e:
                code = e.code()
                message = e.details() or ""
                not_found = None
                for key, value in e.trailing_metadata() or ():
                    if key == NOT_FOUND_KEY:
                        not_found = value
                error = BrokerError(method, code, message, not_found)
                if code not in retried or self._closed.is_set():
                    raise error from None
                delay = policy.delay(attempt, time.monotonic() - began, random.random())
                if delay is None:
                    raise error from None
                log.debug("%s: broker unavailable (%s); retrying in %.2fs", method, message, delay)
                time.sleep(delay)
                attempt += 1

    def _let_go(self, method: str, task: Task, fn: Callable[[pb_grpc.BrokerStub, str, float], T]) -> T:
        """A release or finish of a held task, made under the lease current at each attempt and
        the task's token as it is then (``fn`` builds the request from them): a lease reopened
        meanwhile (Redis lost its state) adopted the task under a new token, or did not take it
        over, and then the call raises ``TaskLost``. When it fails in passing (the broker
        unreachable beyond the retry budget, or no answer), it keeps being retried in a background
        thread until it succeeds, the broker says no, or the lease is closed, so the task's locks
        are never left held by a live lease; the caller still gets the error."""
        with self._lock:
            self._held.pop(task.task_id, None)
            self._ending.append(task)

        def not_lost() -> None:
            # Checked before every call: a reopen that did not take the task over ends it here,
            # not with one more call under the new lease and the old token.
            if task._lost:
                raise TaskLost(task.task_id)

        def attempt() -> T:
            return self._with_lease(method, fn, check=not_lost)[0]

        def done() -> None:
            with self._lock:
                self._ending = [t for t in self._ending if t is not task]

        retrying = False
        try:
            return attempt()
        except BrokerError as e:
            if e.code not in TRANSIENT:
                raise

            def retry() -> None:
                delay = 1.0
                try:
                    while not self._closed.wait(delay):
                        try:
                            attempt()
                            log.info("%s of task %s succeeded on a background retry", method, task.task_id)
                            return
                        except TaskLost as lost:
                            log.warning("background %s of task %s ended: %s", method, task.task_id, lost)
                            return
                        except BrokerError as again:
                            if again.code not in TRANSIENT:
                                log.warning("background %s of task %s ended: %s", method, task.task_id, again)
                                return
                        delay = min(delay * 2, 10.0)
                except Exception:
                    log.exception("background %s of task %s ended", method, task.task_id)
                finally:
                    done()

            log.warning("%s of task %s failed (%s); retrying in the background", method, task.task_id, e)
            threading.Thread(target=retry, name=f"dispatch-retry-{task.task_id}", daemon=True).start()
            retrying = True
            raise
        finally:
            if not retrying:
                done()

    def _with_lease(
        self,
        method: str,
        fn: Callable[[pb_grpc.BrokerStub, str, float], T],
        wait: float = 0.0,
        check: Callable[[], None] | None = None,
        retried: tuple[grpc.StatusCode, ...] = RETRYABLE,
    ) -> tuple[T, int]:
        """A call made with the current lease id; when the broker no longer knows the lease, opens a
        new one (once) and makes the call again. ``check`` runs before each call (also the one
        after a reopen) and may raise to end it; ``retried`` are the codes retried with backoff.
        Returns the reply and the lease generation used."""
        reopened = False
        while True:
            if check is not None:
                check()
            with self._lock:
                lease_id, generation = self._lease_id, self._generation
            try:
                reply = self._call(
                    method, lambda stub, timeout: fn(stub, lease_id, timeout), wait=wait, retried=retried
                )
                return reply, generation
            except BrokerError as e:
                if not e.is_lease_not_found or reopened or self._closing.is_set():
                    raise
                self._reopen(generation, method)
                reopened = True

    def _open_lease(self, app_status_id: str | None) -> pb.Lease:
        request = pb.OpenLeaseRequest(
            worker_name=self.name,
            versions=self.versions,
            ttl=_duration(self.ttl),
            app_status_id=app_status_id or "",
            # One id for this open and its retries: a retry after a lost answer gets the lease the
            # first call opened (and the tasks it adopted), not a second one.
            open_id=str(uuid.uuid4()),
        )
        lease: pb.Lease = self._call("OpenLease", lambda stub, timeout: stub.OpenLease(request, timeout=timeout),
                                     retried=REPEATABLE)
        return lease

    def _install(self, lease: pb.Lease) -> None:
        with self._lock:
            self._install_locked(lease)

    def _install_locked(self, lease: pb.Lease) -> None:
        self._lease_id = lease.lease_id
        self._app_status_id = lease.app_status_id
        if lease.HasField("ttl"):
            self._lease_ttl = lease.ttl.ToTimedelta().total_seconds()
        self._generation += 1

    def _reopen(self, seen_generation: int, why: str) -> None:
        with self._reopening:
            with self._lock:
                if self._generation != seen_generation:
                    return
                old_lease = self._lease_id
            if self._closing.is_set():
                return
            # Only the worker's own (configured) row is reused: a row the broker made belongs to
            # the old lease until the sweeper ends it, which requeues or fails every task claimed
            # for that row and deletes it.
            try:
                lease = self._open_lease(self._configured_app_status)
            except BrokerError as e:
                if not (e.is_app_status_not_found and self._configured_app_status and self._replace_app_status):
                    raise
                replacement = self._replace_app_status()
                log.warning(
                    "the worker's core_appstatus row %s is gone (%s); opening a new lease with row %s",
                    self._configured_app_status, why, replacement,
                )
                self._configured_app_status = replacement
                lease = self._open_lease(replacement)
            adopted = {t.task_id: t.fencing_token for t in lease.adopted_tasks}
            kept, lost = [], []
            # Tokens are updated with the new lease installed, under one lock: no call is made
            # under the new lease with an old token. Adopted tasks this worker still has (held,
            # or being finished or released) are received under their new tokens; any other the
            # new lease adopted is a grant that never arrived, or one this worker no longer runs:
            # the heartbeats hand it back.
            with self._lock:
                self._install_locked(lease)
                for task_id, task in list(self._held.items()):
                    if task_id in adopted:
                        task._token = adopted[task_id]
                        self._undelivered.note_received(task_id, adopted[task_id])
                        kept.append(task_id)
                    else:
                        task._lost = True
                        task.cancelled.set()
                        del self._held[task_id]
                        lost.append(task_id)
                # Tasks being finished or released: the call goes on under the new token, or
                # ends as lost (the broker ended the task with the old lease, or it finished
                # already). A task also held is a newer grant of it: the call letting go of the
                # old one must not act under the new grant's token.
                for task in self._ending:
                    if task.task_id in adopted and task.task_id not in self._held:
                        task._token = adopted[task.task_id]
                        self._undelivered.note_received(task.task_id, task._token)
                        if task.task_id not in kept:
                            kept.append(task.task_id)
                    else:
                        task._lost = True
                        if task.task_id not in lost:
                            lost.append(task.task_id)
            log.warning(
                "the broker no longer knew lease %s (%s); opened %s, adopted %s, lost %s",
                old_lease, why, lease.lease_id, kept, lost,
            )
            self.events.put(LeaseReopened(old_lease, lease.lease_id, kept, lost))

    def _heartbeat_once(self) -> None:
        with self._lock:
            lease_id, generation, ttl = self._lease_id, self._generation, self._lease_ttl
            undelivered = self._undelivered.due_now(generation)
        policy = dataclasses.replace(self.retry, max_elapsed=min(self.retry.max_elapsed, ttl / 3))
        sent = time.monotonic()
        try:
            reply = self._call(
                "Heartbeat",
                lambda stub, timeout: stub.Heartbeat(
                    pb.HeartbeatRequest(lease_id=lease_id, undelivered=undelivered), timeout=timeout),
                retry=policy,
            )
        except BrokerError as e:
            if e.is_lease_not_found and not self._closed.is_set():
                self._reopen(generation, "Heartbeat")
                return
            raise
        with self._lock:
            if undelivered:
                for h in undelivered:
                    log.warning("the broker holds a grant of task %s for this worker that never arrived; handed back",
                                h.task_id)
                self._undelivered.reported(undelivered)
            self._undelivered.listed(reply.held_tasks, generation, sent)
        for task_id in reply.cancel_task_ids:
            with self._lock:
                task = self._held.get(task_id)
            if task is not None and not task.cancelled.is_set():
                log.info("cancel requested for task %s", task_id)
                task.cancelled.set()
                self.events.put(CancelRequested(task_id))

    def _heartbeat_loop(self) -> None:
        while True:
            with self._lock:
                period = self._lease_ttl / 3 * (0.9 + 0.2 * random.random())
            if self._closed.wait(period):
                return
            try:
                self._heartbeat_once()
            except Exception as e:  # noqa: BLE001 - the loop must survive anything
                if self._closed.is_set():
                    return
                log.warning("heartbeat failed: %s", e)
                self.events.put(HeartbeatFailed(str(e)))


class _Authed:
    """The stub with the bearer token added to every call."""

    def __init__(self, stub: pb_grpc.BrokerStub, metadata: tuple[tuple[str, str], ...]):
        self._stub = stub
        self._metadata = metadata

    def future(self, method: str, request: Any, timeout: float) -> Any:
        """The call as a ``grpc.Future`` (which is also its ``grpc.Call``), to wait on or cancel."""
        return getattr(self._stub, method).future(request, timeout=timeout, metadata=self._metadata or None)

    def __getattr__(self, method: str) -> Callable[..., Any]:
        call = getattr(self._stub, method)
        if not self._metadata:
            return call  # type: ignore[no-any-return]

        def with_token(request: Any, timeout: float) -> Any:
            return call(request, timeout=timeout, metadata=self._metadata)

        return with_token


def _duration(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(seconds * 1e9))
    return d
