"""Real Pulp through the broker: pulpcore 3.123.1's own migrations on a throwaway database, tasks
dispatched with pulpcore's own dispatch() and canceled with its cancel_task(), two
pulpcore-broker-worker processes, and the final states, order and locks checked afterwards. The
broker is configured as docs/operations.md advises for production: mutual TLS (certificates made here)
and a bearer token, so the workers and claim_immediate_tasks connect as an operator's would.

Run by `make test-pulp` (scripts/pulp-tests.sh installs pulpcore into a virtualenv); the client's
own tests (`make test-python`) leave this directory out. Without pulpcore the import fails: the
test never skips."""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest

import pulpcore  # noqa: E402, F401  (fails loudly where pulpcore is missing)
import redis  # noqa: E402  (a pulpcore dependency)

from conftest import REPO, Pki, Sandbox, broker_binary, make_pki  # noqa: E402

TOKEN = "pulp-integration-test-token"

SLEEP = "pulpcore.app.tasks.test.sleep"
ASLEEP = "pulpcore.app.tasks.test.asleep"  # immediate tasks must be async
REPO_R = "prn:file.filerepository:R"
LONG = 120.0


def wait_for(what: str, check: Any, limit: float = LONG) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def pulp(sandbox: Sandbox) -> Iterator[dict[str, str]]:
    """A database pulpcore's migrations made, its settings as PULP_* variables, and Django set up
    in this process on it."""
    url = urllib.parse.urlparse(sandbox.postgres_url)
    with psycopg.connect(sandbox.postgres_url, autocommit=True) as conn:
        conn.execute("CREATE DATABASE pulp")
    work = pathlib.Path(tempfile.mkdtemp(prefix="pulp-it-"))
    for d in ("media", "work", "tmp"):
        (work / d).mkdir()
    key = work / "db.key"
    key.write_text("8NQBBpPIlyl6nGVYTdjkJyvOHh5ZWQnjD0kv/jUW5Vs=\n")
    env = {
        "PULP_DATABASES__default__ENGINE": "django.db.backends.postgresql",
        "PULP_DATABASES__default__NAME": "pulp",
        "PULP_DATABASES__default__USER": url.username or "postgres",
        "PULP_DATABASES__default__HOST": url.hostname or "127.0.0.1",
        "PULP_DATABASES__default__PORT": str(url.port),
        "PULP_SECRET_KEY": "throwaway-secret-for-the-integration-test",
        "PULP_CONTENT_ORIGIN": "http://127.0.0.1:24816",
        "PULP_MEDIA_ROOT": str(work / "media"),
        "PULP_WORKING_DIRECTORY": str(work / "work"),
        "PULP_FILE_UPLOAD_TEMP_DIR": str(work / "tmp"),
        "PULP_DB_ENCRYPTION_KEY": str(key),
        "PULP_WORKER_TTL": "6",
        "PULP_ANALYTICS": "false",
        "DJANGO_SETTINGS_MODULE": "pulpcore.app.settings",
    }
    os.environ.update(env)
    manager = shutil.which("pulpcore-manager", path=os.path.dirname(sys.executable))
    assert manager, "pulpcore-manager is not installed beside this Python"
    subprocess.run([manager, "migrate", "--noinput"], check=True, capture_output=True)
    import django

    django.setup()
    from django_guid import set_guid

    set_guid("broker-integration")
    yield {**env, "PULP_DB_URL": sandbox.postgres_url.rsplit("/", 1)[0] + "/pulp"}
    shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def tls_options(pki: Pki) -> list[str]:
    """The client side of mutual TLS, as options of `dispatch-broker health` and of
    pulpcore-broker-worker (the broker's certificate names "localhost", dialled at 127.0.0.1)."""
    return [
        "--tls-ca", str(pki.ca), "--tls-domain", "localhost",
        "--tls-cert", str(pki.client_cert), "--tls-key", str(pki.client_key),
    ]


@pytest.fixture(scope="module")
def broker(sandbox: Sandbox, pulp: dict[str, str], pki: Pki) -> Iterator[str]:
    """`dispatch-broker migrate` must find Pulp's database complete and change nothing; then a
    broker serves it (its own Redis key prefix beside the sandbox's broker) with mutual TLS and a
    worker token."""
    migrate = subprocess.run(
        [broker_binary(), "migrate", "--postgres-url", pulp["PULP_DB_URL"]],
        capture_output=True,
        text=True,
    )
    assert migrate.returncode == 0, migrate.stderr
    assert "changed nothing" in migrate.stdout, migrate.stdout
    assert "has everything dispatch-broker needs" in migrate.stdout, migrate.stdout
    redis_url = sandbox.redis_url
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        metrics_port = s.getsockname()[1]
    process = subprocess.Popen(
        [
            broker_binary(),
            "serve",
            "--postgres-url",
            pulp["PULP_DB_URL"],
            "--redis-url",
            redis_url,
            "--redis-key-prefix",
            "pulp",
            "--listen",
            f"127.0.0.1:{port}",
            "--metrics-listen",
            f"127.0.0.1:{metrics_port}",
            "--sweep-interval",
            "1s",
            "--tls-cert",
            str(pki.server_cert),
            "--tls-key",
            str(pki.server_key),
            "--tls-client-ca",
            str(pki.ca),
        ],
        env={**os.environ, "DISPATCH_AUTH_TOKEN": TOKEN},
        stderr=subprocess.DEVNULL,
    )
    address = f"127.0.0.1:{port}"
    wait_for(
        "the broker to serve",
        lambda: subprocess.run(
            [broker_binary(), "health", "--addr", f"https://{address}", *tls_options(pki)], capture_output=True
        ).returncode
        == 0,
        30,
    )
    yield address
    process.send_signal(signal.SIGTERM)
    process.wait(30)


def start_workers(n: int, address: str, env: dict[str, str], pki: Pki) -> list[subprocess.Popen[bytes]]:
    """Workers connecting with mutual TLS and the token: the even ones told by options, the odd
    ones by DISPATCH_BROKER_* variables."""
    script = shutil.which("pulpcore-broker-worker", path=os.path.dirname(sys.executable))
    assert script, "pulpcore-broker-worker is not installed beside this Python"
    by_env = {
        "DISPATCH_BROKER_ADDRESS": address,
        "DISPATCH_BROKER_TOKEN": TOKEN,
        "DISPATCH_BROKER_TLS_CA": str(pki.ca),
        "DISPATCH_BROKER_TLS_DOMAIN": "localhost",
        "DISPATCH_BROKER_TLS_CERT": str(pki.client_cert),
        "DISPATCH_BROKER_TLS_KEY": str(pki.client_key),
    }
    by_options = ["--broker", address, "--token", TOKEN, *tls_options(pki)]
    return [
        subprocess.Popen(
            [script, *([] if i % 2 else by_options), "--name-template", f"broker-worker-{i}@{{hostname}}"],
            env={**os.environ, **env, **(by_env if i % 2 else {})},
            cwd=tempfile.gettempdir(),
        )
        for i in range(n)
    ]


def test_pulp_tasks_run_through_the_broker(sandbox: Sandbox, broker: str, pulp: dict[str, str], pki: Pki) -> None:
    from django.utils import timezone

    from pulpcore.app.models import AppStatus, Domain, Task
    from pulpcore.app.util import set_domain
    from pulpcore.constants import TASK_FINAL_STATES
    from dispatch_broker_client import TlsConfig
    from dispatch_broker_client.pulp import claim_immediate_tasks
    from pulpcore.tasking.tasks import cancel_task, dispatch

    started = time.monotonic()
    # This process plays Pulp's API: it dispatches and cancels with pulpcore's own functions, and
    # runs immediate tasks itself once the broker grants them (ClaimTask).
    AppStatus.objects.create(name="integration-api", app_type="api")
    tls = TlsConfig.from_files(pki.ca, "localhost", cert=pki.client_cert, key=pki.client_key)
    api_lease = claim_immediate_tasks(broker, token=TOKEN, tls=tls)
    r = redis.Redis.from_url(sandbox.redis_url)
    dispatched: dict[str, Any] = {}

    def dispatch_immediate() -> None:
        from django_guid import set_guid

        set_guid("broker-integration-immediate")
        dispatched["task"] = dispatch(
            ASLEEP, args=(1.0,), exclusive_resources=["prn:file.filerepository:F"], immediate=True
        )

    thread = threading.Thread(target=dispatch_immediate)
    thread.start()
    # No worker runs yet: the only task lock there can be is the immediate task's, held through
    # the broker while this process runs it.
    wait_for("the immediate task's lock in the broker", lambda: any(r.scan_iter("{pulp}:task:*")), 30)
    thread.join(30)
    ran_here = dispatched["task"]
    assert ran_here.state == "completed", "granted by the broker, run by the API process at once"
    assert not any(r.scan_iter("{pulp}:task:*")), "released once it ran"
    # The long task that gets canceled while running.
    # The head of one repository's queue: runs until it is canceled (the incident's blocked head).
    long_running = dispatch(SLEEP, args=(60,), exclusive_resources=[REPO_R])
    # A queue on one repository, and an immediate task behind it (deferred: R is busy).
    repo_tasks = [dispatch(SLEEP, args=(0.3,), exclusive_resources=[REPO_R]) for _ in range(5)]
    canceled_waiting = dispatch(SLEEP, args=(0.3,), exclusive_resources=[REPO_R])
    immediate = dispatch(ASLEEP, args=(0.1,), exclusive_resources=[REPO_R], immediate=True, deferred=True)
    assert immediate.state == "waiting", "R was busy: the immediate task was deferred to the workers"
    repo_tasks.append(dispatch(SLEEP, args=(0.3,), exclusive_resources=[REPO_R]))
    # Tasks of other domains, behind the repository's queue.
    other = Domain.objects.create(
        name="other",
        storage_class="pulpcore.app.models.storage.FileSystem",
        storage_settings={"location": pulp["PULP_MEDIA_ROOT"] + "/other"},
    )
    set_domain(other)
    other_tasks = [
        dispatch(SLEEP, args=(0.1,), exclusive_resources=[f"prn:file.filerepository:O{i}"]) for i in range(4)
    ]
    set_domain(Domain.objects.get(name="default"))
    cancel_task(canceled_waiting.pk)
    # An API process that died with an immediate task marked but not started, and one running:
    # the workers' clean-up of missing processes requeues the first and fails the second.
    dead_api = AppStatus(name="dead-api", app_type="api", ttl=timedelta(seconds=1))
    dead_api.save()
    AppStatus.objects.filter(pk=dead_api.pk).update(last_heartbeat=timezone.now() - timedelta(hours=1))
    orphan_marked = dispatch(SLEEP, args=(0.1,), exclusive_resources=["prn:file.filerepository:M"])
    orphan_running = dispatch(SLEEP, args=(0.1,), exclusive_resources=["prn:file.filerepository:N"])
    Task.objects.filter(pk=orphan_marked.pk).update(app_lock=dead_api)
    Task.objects.filter(pk=orphan_running.pk).update(app_lock=dead_api, state="running", started_at=timezone.now())

    workers = start_workers(2, broker, pulp, pki)
    try:
        wait_for("the long task to run", lambda: Task.objects.get(pk=long_running.pk).state == "running")
        # While the repository's head runs, the other domain's tasks (newer than the whole
        # repository queue) are all done by the other worker: no head-of-line blocking.
        wait_for(
            "the other domain's tasks",
            lambda: all(Task.objects.get(pk=t.pk).state == "completed" for t in other_tasks),
        )
        assert Task.objects.get(pk=long_running.pk).state == "running"
        assert not Task.objects.filter(pk__in=[t.pk for t in repo_tasks]).exclude(started_at=None).exists()
        cancel_task(long_running.pk)
        every = [
            ran_here, long_running, canceled_waiting, immediate, orphan_marked, orphan_running,
            *repo_tasks, *other_tasks,
        ]
        wait_for(
            "every task to reach a final state",
            lambda: not Task.objects.filter(pk__in=[t.pk for t in every]).exclude(state__in=TASK_FINAL_STATES).exists(),
        )
    finally:
        for w in workers:
            w.send_signal(signal.SIGTERM)
        codes = [w.wait(60) for w in workers]
        api_lease.close()
    elapsed = time.monotonic() - started

    states = {t.pk: Task.objects.get(pk=t.pk) for t in every}
    assert states[long_running.pk].state == "canceled"
    assert states[canceled_waiting.pk].state == "canceled"
    assert states[canceled_waiting.pk].started_at is None, "it never ran"
    assert states[immediate.pk].state == "completed", states[immediate.pk].error
    assert states[orphan_marked.pk].state == "completed", "requeued from the dead process and run"
    assert states[orphan_running.pk].state == "failed"
    assert states[orphan_running.pk].error == {"reason": "Worker has gone missing."}
    assert not AppStatus.objects.filter(name="dead-api").exists()
    for t in [*repo_tasks, *other_tasks]:
        assert states[t.pk].state == "completed", (t.pk, states[t.pk].state, states[t.pk].error)
    assert codes == [0, 0], "the workers shut down cleanly on SIGTERM"

    # The repository's tasks ran one at a time, in the order they were dispatched (the immediate
    # task in its place), never overlapping.
    in_order = sorted([*repo_tasks, immediate], key=lambda t: (t.pulp_created, t.pk))
    runs = [states[t.pk] for t in in_order]
    for before, after in zip(runs, runs[1:]):
        assert before.finished_at <= after.started_at, (before.pk, after.pk)
    assert states[long_running.pk].finished_at <= runs[0].started_at, "the canceled head came first"

    # The workers' rows are gone and no lock is left.
    assert not AppStatus.objects.filter(app_type="worker").exists()
    leftovers = [k for k in r.scan_iter("{pulp}:*") if b":task:" in k or b":x:" in k or b":s:" in k]
    assert leftovers == []
    assert r.scard("{pulp}:locked") == 0
    print(f"\n{len(every)} Pulp tasks in {elapsed:.1f}s through the broker with 2 workers")


def test_a_worker_whose_row_pulp_deleted_opens_a_new_lease_and_goes_on(broker: str, pulp: dict[str, str], pki: Pki) -> None:
    """pulpcore's own workers delete the row of any process whose heartbeat is older than its TTL
    (after a Postgres outage longer than the TTL, say, during which the broker could not write
    heartbeats), clearing the claims of its tasks (Django's SET_NULL). The broker then ends that
    worker's lease: the task it was running fails as Pulp fails an abandoned task, and the worker
    writes its row again, opens a new lease and runs the next task."""
    from pulpcore.app.models import AppStatus, Task
    from pulpcore.tasking.tasks import dispatch

    repo = "prn:file.filerepository:G"
    workers = start_workers(1, broker, pulp, pki)
    try:
        long_running = dispatch(SLEEP, args=(60,), exclusive_resources=[repo])
        wait_for("the long task to run", lambda: Task.objects.get(pk=long_running.pk).state == "running")
        first = AppStatus.objects.get(app_type="worker")
        assert Task.objects.get(pk=long_running.pk).app_lock_id == first.pk
        # As pulpcore's app_worker_cleanup() deletes a missing process's row.
        AppStatus.objects.filter(pk=first.pk).delete()
        assert Task.objects.get(pk=long_running.pk).app_lock_id is None
        behind = dispatch(SLEEP, args=(0.1,), exclusive_resources=[repo])
        wait_for("the abandoned task to fail", lambda: Task.objects.get(pk=long_running.pk).state == "failed", 60)
        wait_for("the next task to run", lambda: Task.objects.get(pk=behind.pk).state == "completed", 60)
        rows = list(AppStatus.objects.filter(app_type="worker"))
    finally:
        for w in workers:
            w.send_signal(signal.SIGTERM)
        codes = [w.wait(60) for w in workers]
    assert Task.objects.get(pk=long_running.pk).error == {"reason": "Worker has gone missing."}
    assert [r.pk for r in rows] == [first.pk], "the worker's row was written again, for its new lease"
    assert codes == [0], "the worker shut down cleanly on SIGTERM"
    assert not AppStatus.objects.filter(app_type="worker").exists()


def test_a_worker_that_finishes_a_task_across_a_redis_loss_releases_it_and_goes_on(
    sandbox: Sandbox, broker: str, pulp: dict[str, str], pki: Pki
) -> None:
    """Redis loses the broker's lock state while a Pulp worker runs a task (a restart without
    persistence). The broker rebuilds the task's locks from Postgres for the worker's row; when
    the task ends, the worker's release meets a lease the broker no longer knows, reopens it under
    its row, takes the task over with a new token and releases under that one, well before the
    rebuilt lease could expire: the next task on the repository runs, and the worker goes on."""
    from pulpcore.app.models import Task
    from pulpcore.tasking.tasks import dispatch

    repo = "prn:file.filerepository:H"
    r = redis.Redis.from_url(sandbox.redis_url)
    # A TTL of 60 s: the worker's first heartbeat comes 20 s after it started, so the release,
    # not a heartbeat, is the first call to meet the lost lease, and the rebuilt lease would
    # keep the task's locks for 60 s.
    workers = start_workers(1, broker, {**pulp, "PULP_WORKER_TTL": "60"}, pki)
    try:
        running = dispatch(SLEEP, args=(2,), exclusive_resources=[repo])
        wait_for("the task to run", lambda: Task.objects.get(pk=running.pk).state == "running")
        behind = dispatch(SLEEP, args=(0.1,), exclusive_resources=[repo])
        lost_at = time.monotonic()
        for key in r.scan_iter("{pulp}:*"):
            r.delete(key)
        wait_for("the running task to complete", lambda: Task.objects.get(pk=running.pk).state == "completed", 30)
        # The next task runs well before the rebuilt lease could expire only when the worker
        # released under the new token.
        wait_for("the next task to complete", lambda: Task.objects.get(pk=behind.pk).state == "completed", 15)
        took = time.monotonic() - lost_at
    finally:
        for w in workers:
            w.send_signal(signal.SIGTERM)
        codes = [w.wait(60) for w in workers]
    assert took < 15, took
    assert codes == [0], "the worker shut down cleanly on SIGTERM"
    leftovers = [k for k in r.scan_iter("{pulp}:*") if b":task:" in k or b":x:" in k or b":s:" in k]
    assert leftovers == []
