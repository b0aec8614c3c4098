"""A Pulp (pulpcore 3.123) worker whose locks, liveness and cancellation go through dispatch-broker.

Pulp's own task execution stays: the worker registers its ``core_appstatus`` row, runs each task
in a subprocess through ``pulpcore.tasking._util.perform_task`` (immediate tasks in-process through
``pulpcore.tasking.tasks.execute_task``), which sets the task running, executes it and records its
final state, and it cleans up canceled tasks as Pulp does. What the broker now owns is replaced:

* no Redis locks in the worker: ``FetchTask`` hands out the oldest ready task, locked and claimed
  under the worker's lease (``app_lock`` is the worker's own row);
* ``ReleaseLocks`` after the task ended (a task that never started goes back to the queue);
* cancellation arrives in the heartbeat reply (Pulp's API sets the task ``canceling``);
* liveness is the lease: the broker's heartbeats refresh the row's ``last_heartbeat``, and a dead
  worker's lease expires, which releases its locks and fails its running tasks.

Run ``pulpcore-broker-worker --broker HOST:PORT`` with the usual Pulp settings (``PULP_*``
environment or settings file); ``--tls-ca`` (and ``--tls-cert``/``--tls-key`` for mutual TLS)
for a broker serving TLS. Pulp's API and content processes keep ``WORKER_TYPE = "pulpcore"``.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from multiprocessing import Process
from tempfile import TemporaryDirectory
from typing import Any

from .worker import Task as BrokerTask
from .worker import TaskLost, TlsConfig, Worker

log = logging.getLogger("dispatch_broker_client.pulp")


def _release(granted: BrokerTask) -> None:
    """Releases a grant's locks, unless it is lost: its lease ended and the new lease did not take
    it over (the broker ended the task with the old lease). That can also turn out during the
    release itself, when the lease was gone before the heartbeat noticed."""
    if granted.lost:
        return
    try:
        granted.release()
    except TaskLost:
        log.warning("Task %s was lost with its lease; its locks went with it.", granted.task_id)


# How often a supervised task's subprocess is checked (cancel requests, a lost lease, shutdown).
SUPERVISE_INTERVAL = 0.2
# Seconds between repeated abort signals to a task that does not stop.
KILL_INTERVAL = 1.0
# Beats (each WORKER_TTL/3) between clean-ups of missing app processes' rows; the first beat
# cleans up at once.
CLEANUP_INTERVAL = 30


class BrokerPulpWorker:
    """One Pulp worker process."""

    def __init__(self, broker: str, token: str | None = None, tls: TlsConfig | None = None):
        from django.conf import settings

        from pulpcore.app.apps import pulp_plugin_configs
        from pulpcore.app.models import AppStatus
        from pulpcore.app.util import get_worker_name

        self.name = get_worker_name()
        self.versions = {app.label: app.version for app in pulp_plugin_configs()}
        self.app_status = AppStatus.objects.create(name=self.name, app_type="worker", versions=self.versions)
        self.poll = float(settings.WORKER_TTL) / 3
        self.grace = float(settings.TASK_GRACE_INTERVAL)
        self.worker = Worker(
            broker,
            self.name,
            versions=self.versions,
            ttl=float(settings.WORKER_TTL),
            token=token,
            tls=tls,
            app_status_id=str(self.app_status.pk),
            replace_app_status=self._replace_app_status,
        )
        self.shutdown_requested = False
        # None: a running task may finish however long it takes (SIGTERM, SIGHUP); otherwise the
        # monotonic time after which it is aborted (SIGINT: TASK_GRACE_INTERVAL).
        self.abort_at: float | None = None
        self.next_beat = 0.0
        self.cleanup_countdown = 0

    def _replace_app_status(self) -> str:
        """The worker's row is gone (Pulp's clean-up of missing processes deleted it: its
        heartbeats could not be written for a TTL, during a Postgres outage say; the broker then
        ended its lease). It is written again, under the same id (pulpcore keeps one row per
        process, ``AppStatus.objects.current()``), for the new lease."""
        import threading

        from django.db import IntegrityError, connection
        from django.utils import timezone

        try:
            self.app_status.last_heartbeat = timezone.now()
            self.app_status.save(force_insert=True)
        except IntegrityError:
            pass  # already there again: the new lease takes it
        finally:
            if threading.current_thread() is not threading.main_thread():
                connection.close()  # the heartbeat thread's own connection: not kept open
        log.warning("Worker %s lost its row; it was written again (%s).", self.name, self.app_status.pk)
        return str(self.app_status.pk)

    def _signal(self, signum: int, frame: Any) -> None:
        if signum in (signal.SIGTERM, signal.SIGHUP):
            log.info("Worker %s was requested to shut down gracefully.", self.name)
            self.abort_at = None
        else:
            # A second signal is not graceful any more.
            for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(s, signal.SIG_DFL)
            log.info("Worker %s was requested to shut down.", self.name)
            self.abort_at = time.monotonic() + self.grace
        self.shutdown_requested = True
        self.worker.stop()

    def run(self, burst: bool = False) -> int:
        """Fetches and runs tasks until a shutdown signal (or, with ``burst``, until none is
        ready); closes the lease and removes the worker's row at the end. Returns the number of
        tasks handled."""
        from pulpcore.tasking._util import startup_hook
        from pulpcore.tasking.storage import WorkerDirectory

        handled = 0
        with WorkerDirectory(self.name):
            for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(s, self._signal)
            self.worker.open()
            log.info("Worker %s serves tasks from the broker (lease %s).", self.name, self.worker.lease_id)
            try:
                startup_hook()
                while not self.worker.stopping.is_set():
                    self.beat()
                    task = self.worker.fetch(wait=0.0 if burst else self.poll)
                    if task is None:
                        if burst:
                            break
                        continue
                    if self.worker.stopping.is_set():
                        # Granted while shutdown began: back to the queue, not run.
                        _release(task)
                        break
                    handled += 1
                    self.handle(task)
            finally:
                self.worker.close()
                self.app_status.delete()
                log.info("Worker %s was shut down after %d task(s).", self.name, handled)
        return handled

    def beat(self) -> None:
        """Pulp's periodic duty that stays with the workers: dispatching scheduled tasks (one
        worker at a time, under Pulp's advisory lock)."""
        now = time.monotonic()
        if now < self.next_beat:
            return
        self.next_beat = now + self.poll
        from django.db import connection, transaction

        from pulpcore.constants import TASK_SCHEDULING_LOCK, WORKER_CLEANUP_LOCK
        from pulpcore.tasking._util import dispatch_scheduled_tasks

        def exclusive(lock: int, duty: Any) -> None:
            with transaction.atomic():
                with connection.cursor() as cursor:
                    cursor.execute("SELECT pg_try_advisory_xact_lock(%s, %s)", [0, lock])
                    if cursor.fetchone()[0]:
                        duty()

        exclusive(TASK_SCHEDULING_LOCK, dispatch_scheduled_tasks)
        self.cleanup_countdown -= 1
        if self.cleanup_countdown <= 0:
            self.cleanup_countdown = CLEANUP_INTERVAL
            exclusive(WORKER_CLEANUP_LOCK, self.cleanup_missing_apps)

    def cleanup_missing_apps(self) -> None:
        """Pulp's clean-up of app processes that stopped heartbeating, minus what the broker owns.
        A missing API or content process's tasks are dealt with as Pulp does (a task it had marked
        but not started goes back to the queue; one it was running fails); a missing worker's
        tasks are the broker's (its lease expires and is swept), so its row goes only once none is
        left. Then the row is deleted."""
        from pulpcore.app.models import AppStatus, Task
        from pulpcore.constants import TASK_FINAL_STATES, TASK_STATES

        for app in list(AppStatus.objects.missing()):
            incomplete = Task.objects.filter(app_lock=app).exclude(state__in=TASK_FINAL_STATES)
            if app.app_type == "worker":
                if incomplete.exists():
                    continue
            else:
                for task in list(incomplete):
                    try:
                        if task.state == TASK_STATES.WAITING:
                            Task.objects.filter(pk=task.pk, app_lock=app, state=TASK_STATES.WAITING).update(
                                app_lock=None
                            )
                            continue
                        Task.objects.filter(pk=task.pk, app_lock=app).update(app_lock=self.app_status)
                        task.app_lock = self.app_status
                        task.set_canceling()
                        task.set_canceled(final_state=TASK_STATES.FAILED, reason="Worker has gone missing.")
                        log.warning("Failed task %s of missing %s process %s.", task.pk, app.app_type, app.name)
                    except Exception:
                        log.exception("Cleaning up task %s of missing process %s failed.", task.pk, app.name)
            log.warning("Cleanup record of missing %s process %s.", app.app_type, app.name)
            app.delete()

    def handle(self, granted: BrokerTask) -> None:
        """Runs one granted task the way Pulp does, then releases its locks."""
        from pulpcore.app.models import Task
        from pulpcore.constants import TASK_STATES

        try:
            task = Task.objects.select_related("pulp_domain").get(pk=granted.task_id)
            if task.state == TASK_STATES.CANCELING:
                # Canceled between the grant and now: it never ran.
                task.set_canceled()
            elif task.state == TASK_STATES.WAITING:
                if task.immediate:
                    self.run_immediate(task)
                else:
                    self.supervise(task, granted)
        except Exception:
            log.exception("Handling task %s failed.", granted.task_id)
        finally:
            # A task that never started goes back to the queue; any other just unlocks.
            _release(granted)

    def run_immediate(self, task: Any) -> None:
        """An immediate task runs in this process, as Pulp runs it."""
        from pulpcore.tasking.tasks import execute_task, using_workdir

        log.info("Worker %s executes immediate task %s.", self.name, task.pk)
        with using_workdir():
            execute_task(task)

    def supervise(self, task: Any, granted: BrokerTask) -> None:
        """Runs the task in a subprocess (Pulp's perform_task) and watches it: a cancel request
        from the heartbeat reply or a shutdown past its grace aborts it (SIGUSR1, as Pulp does);
        a lost lease kills it at once, since the broker has already handed its locks back."""
        from pulpcore.constants import TASK_FINAL_STATES, TASK_STATES
        from pulpcore.tasking._util import delete_incomplete_resources, perform_task

        cancel_state: str | None = None
        reason: str | None = None
        last_signal = 0.0
        with TemporaryDirectory(dir=".") as workdir:
            process = Process(target=perform_task, args=(task.pk, workdir))
            process.start()
            assert process.pid is not None
            while True:
                process.join(SUPERVISE_INTERVAL)
                if not process.is_alive():
                    break
                if granted.lost:
                    log.error("The lease of task %s ended; killing it (its locks are gone).", task.pk)
                    os.kill(process.pid, signal.SIGKILL)
                    process.join()
                    return
                if cancel_state is None and granted.cancelled.is_set():
                    log.info("Received signal to cancel current task %s.", task.pk)
                    cancel_state = TASK_STATES.CANCELED
                if (
                    cancel_state is None
                    and self.shutdown_requested
                    and self.abort_at is not None
                    and time.monotonic() > self.abort_at
                ):
                    log.info("Aborting current task %s due to worker shutdown.", task.pk)
                    cancel_state = TASK_STATES.FAILED
                    reason = "Aborted during worker shutdown."
                if cancel_state is not None and time.monotonic() - last_signal > KILL_INTERVAL:
                    last_signal = time.monotonic()
                    os.kill(process.pid, signal.SIGUSR1)
            if cancel_state is None and process.exitcode != 0:
                log.warning("Task process for %s exited with non zero exitcode %s.", task.pk, process.exitcode)
                cancel_state = TASK_STATES.FAILED
                if process.exitcode is not None and process.exitcode < 0:
                    reason = f"Killed by signal {-process.exitcode}."
        if cancel_state is not None:
            task.refresh_from_db()
            if task.state not in TASK_FINAL_STATES:
                task.set_canceling()
                log.info("Cleaning up task %s and marking as %s.", task.pk, cancel_state)
                delete_incomplete_resources(task)
                task.set_canceled(final_state=cancel_state, reason=reason)


def claim_immediate_tasks(broker: str, token: str | None = None, tls: TlsConfig | None = None) -> Worker:
    """Makes this Pulp API process run immediate tasks under the broker's locks: when pulpcore's
    ``dispatch()`` asks whether an immediate task may run now, the broker answers (``ClaimTask``
    under a lease on this process's own ``core_appstatus`` row, so held locks count, not only older
    tasks), and the task's locks are released (``ReleaseLocks``) once Pulp ran it. A task the
    broker does not grant is deferred to the workers, as Pulp does. Call once per process after
    Django is set up (e.g. from gunicorn's ``post_worker_init`` hook); returns the lease's
    ``Worker``, to ``close()`` at exit. ``token`` and ``tls`` as for ``Worker`` (``tls_from_env()``
    reads the worker command's ``DISPATCH_BROKER_TLS_*`` variables)."""
    import threading

    from asgiref.sync import sync_to_async
    from django.conf import settings

    import pulpcore.tasking.tasks as tasks
    from pulpcore.app.apps import pulp_plugin_configs
    from pulpcore.app.models import AppStatus

    current = AppStatus.objects.current()
    lease = Worker(
        broker,
        current.name,
        versions={app.label: app.version for app in pulp_plugin_configs()},
        ttl=float(settings.WORKER_TTL),
        token=token,
        tls=tls,
        app_status_id=str(current.pk),
    ).open()
    grants: dict[str, BrokerTask] = {}
    grants_lock = threading.Lock()
    original_execute, original_aexecute = tasks.execute_task, tasks.aexecute_task

    def are_resources_available(colliding_resources: Any, task: Any) -> bool:
        try:
            granted = lease.claim(str(task.pk))
        except Exception:  # noqa: BLE001 - the broker unreachable: defer (Pulp unmarks the task)
            log.exception("ClaimTask for immediate task %s failed; deferring it to the workers", task.pk)
            return False
        if granted is None:
            return False
        with grants_lock:
            grants[str(task.pk)] = granted
        return True

    def finish(task: Any) -> None:
        with grants_lock:
            granted = grants.pop(str(task.pk), None)
        if granted is not None:
            _release(granted)

    def execute_task(task: Any) -> None:
        try:
            original_execute(task)
        finally:
            finish(task)

    async def aexecute_task(task: Any) -> None:
        try:
            await original_aexecute(task)
        finally:
            await sync_to_async(finish)(task)

    tasks.are_resources_available = are_resources_available
    tasks.async_are_resources_available = sync_to_async(are_resources_available)
    tasks.execute_task = execute_task
    tasks.aexecute_task = aexecute_task
    return lease


# The worker command's TLS options: (option, variable, what it holds).
TLS_OPTIONS = (
    ("--tls-ca", "DISPATCH_BROKER_TLS_CA", "PEM CA bundle the broker's certificate must chain to (implies TLS)"),
    ("--tls-domain", "DISPATCH_BROKER_TLS_DOMAIN", "the name the broker's certificate must carry (default: the host of --broker)"),
    ("--tls-cert", "DISPATCH_BROKER_TLS_CERT", "client certificate (PEM) for mutual TLS, with --tls-key (implies TLS)"),
    ("--tls-key", "DISPATCH_BROKER_TLS_KEY", "private key (PEM) of --tls-cert"),
)


def _tls(values: dict[str, str | None], broker: str) -> TlsConfig | None:
    """TLS settings from the options' values (by option name): None when none is given and the
    address is not ``https://``. ValueError names an option whose file cannot be read."""
    if not any(values.values()) and not broker.startswith("https://"):
        return None
    read: dict[str, bytes | None] = {}
    for option, env, _ in TLS_OPTIONS:
        path = values.get(option)
        if option == "--tls-domain" or not path:
            continue
        try:
            with open(path, "rb") as f:
                read[option] = f.read()
        except OSError as e:
            raise ValueError(f"cannot read {option} ({env}) {path}: {e.strerror}") from None
    if ("--tls-cert" in read) != ("--tls-key" in read):
        raise ValueError("--tls-cert and --tls-key (DISPATCH_BROKER_TLS_CERT, DISPATCH_BROKER_TLS_KEY) go together")
    return TlsConfig(
        ca=read.get("--tls-ca"),
        domain=values.get("--tls-domain") or None,
        cert=read.get("--tls-cert"),
        key=read.get("--tls-key"),
    )


def tls_from_env(broker: str = "") -> TlsConfig | None:
    """TLS settings from ``DISPATCH_BROKER_TLS_CA``, ``..._DOMAIN``, ``..._CERT`` and ``..._KEY``
    (the worker command's variables), for ``claim_immediate_tasks`` in an API process; None when
    none is set (and ``broker`` is not ``https://``)."""
    return _tls({option: os.environ.get(env) for option, env, _ in TLS_OPTIONS}, broker)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The worker command's arguments; ``tls`` is the TLS configuration (None: plaintext). Exits
    with a one-line message on bad input, as argparse does."""
    parser = argparse.ArgumentParser(
        prog="pulpcore-broker-worker",
        description="A Pulp worker whose resource locks, liveness and cancellation go through "
        "dispatch-broker. Pulp settings come from the usual PULP_* environment and settings file.",
    )
    parser.add_argument(
        "--broker",
        default=os.environ.get("DISPATCH_BROKER_ADDRESS", "127.0.0.1:50051"),
        help="the broker's gRPC address, host:port (https://host:port: TLS with the system's CAs) "
        "(env DISPATCH_BROKER_ADDRESS)",
    )
    parser.add_argument(
        "--token",
        default=os.environ.get("DISPATCH_BROKER_TOKEN"),
        help="bearer token for the broker (env DISPATCH_BROKER_TOKEN)",
    )
    for option, env, text in TLS_OPTIONS:
        parser.add_argument(option, default=os.environ.get(env), help=f"{text} (env {env})")
    parser.add_argument("--burst", action="store_true", help="exit once no task is ready")
    parser.add_argument(
        "--name-template",
        help="format of the worker's name; '{pid}', '{hostname}' and '{fqdn}' are substituted",
    )
    args = parser.parse_args(argv)
    values = {option: getattr(args, option[2:].replace("-", "_")) for option, _, _ in TLS_OPTIONS}
    try:
        args.tls = _tls(values, args.broker)
    except ValueError as e:
        parser.error(str(e))
    return args


def main(argv: list[str] | None = None) -> int:
    """``pulpcore-broker-worker``: a Pulp worker served by dispatch-broker."""
    args = parse_args(argv)

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "pulpcore.app.settings")
    import django

    django.setup()
    from django.conf import settings

    if args.name_template:
        settings.set("WORKER_NAME_TEMPLATE", args.name_template)
    try:
        BrokerPulpWorker(args.broker, args.token, args.tls).run(burst=args.burst)
    except Exception as e:  # noqa: BLE001 - one line for the operator, not a traceback
        log.exception("pulpcore-broker-worker failed")
        print(f"pulpcore-broker-worker: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
