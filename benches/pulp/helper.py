"""pulpcore's side of `cargo bench --bench pulp`: runs in pulpcore 3.123.1's own environment (Django
set up on a database its migrations made) and does what Pulp does, on request from the bench:
dispatch() tasks (its insert trigger and wake-up notification), cancel_task() waiting tasks, and
pulpcore's own RedisWorker.fetch_task() as the baseline, timed here.

One JSON request per line on stdin, one JSON answer per line on stdout. The bench sets the PULP_*
variables (database, Redis) before starting this process."""

from __future__ import annotations

import itertools
import json
import sys
import time

import django

django.setup()

from django.db import connection  # noqa: E402
from django.utils import timezone  # noqa: E402
from django_guid import set_guid  # noqa: E402

from pulpcore.app.models import AppStatus, Task  # noqa: E402
from pulpcore.app.util import get_domain, get_prn  # noqa: E402
from pulpcore.constants import TASK_STATES  # noqa: E402
from pulpcore.tasking import redis_worker  # noqa: E402
from pulpcore.tasking.redis_locks import (  # noqa: E402
    acquire_locks,
    extract_task_resources,
    get_task_lock_key,
    safe_release_task_locks,
)
from pulpcore.tasking.tasks import cancel_task, dispatch  # noqa: E402

set_guid("dispatch-broker-bench")
SLEEP = "pulpcore.app.tasks.test.sleep"
counter = itertools.count()
workers: list[redis_worker.RedisWorker] = []


def domain(_: dict) -> dict:
    """The domain's resource name and the component versions a worker of this install has."""
    from pulpcore.app.apps import pulp_plugin_configs

    versions = {app.label: app.version for app in pulp_plugin_configs()}
    return {"prn": get_prn(get_domain()), "versions": versions}


def dispatch_tasks(req: dict) -> dict:
    """Tasks of another domain's repositories, inserted as Pulp inserts them."""
    ids = []
    for _ in range(req["n"]):
        repo = f"{req['prefix']}{next(counter)}"
        task = dispatch(SLEEP, args=(0,), exclusive_resources=[f"prn:file.filerepository:{repo}"])
        ids.append(str(task.pk))
    return {"ids": ids}


def cancel_waiting(req: dict) -> dict:
    """Cancels waiting tasks on a resource through Pulp's own cancel_task(), from the middle of
    its queue."""
    waiting = Task.objects.filter(
        state=TASK_STATES.WAITING, reserved_resources_record__contains=[req["resource"]]
    ).order_by("pulp_created")
    count = waiting.count()
    picked = [t.pk for t in waiting[count // 2 : count // 2 + req["n"]]]
    for pk in picked:
        cancel_task(pk)
    return {"canceled": len(picked)}


def baseline_setup(req: dict) -> dict:
    """pulpcore's Redis locks for the running head, and RedisWorker instances (one Python process,
    so each gets a name of its own)."""
    head = Task.objects.get(pk=req["head"])
    exclusive, shared = extract_task_resources(head)
    holder = redis_worker.RedisWorker.__new__(redis_worker.RedisWorker)
    from pulpcore.app.redis_connection import get_redis_connection

    blocked = acquire_locks(get_redis_connection(), "head-holder", get_task_lock_key(head.pk), exclusive, shared)
    assert not blocked, blocked
    names = iter(f"baseline-{i}@bench" for i in range(10_000))
    redis_worker.get_worker_name = lambda: next(names)
    while len(workers) < req["workers"]:
        # pulpcore allows one app status per process; these stand for ten worker processes.
        AppStatus.objects._current_app_status = None
        workers.append(redis_worker.RedisWorker())
    del holder
    return {"workers": len(workers)}


def baseline_round(req: dict) -> dict:
    """Each worker fetches once (timed), then finishes the task (running, completed, locks
    released) or, with requeue, puts the claim back (locks released, app_lock cleared)."""
    took = []
    got = []
    for worker in workers:
        started = time.perf_counter()
        task = worker.fetch_task()
        took.append((time.perf_counter() - started) * 1000.0)
        if task is None:
            continue
        got.append(task)
        # (Task.set_running() checks the process's single app status; these ten share a process.)
        if req["mode"] == "finish":
            Task.objects.filter(pk=task.pk).update(state=TASK_STATES.RUNNING, started_at=timezone.now())
        else:
            Task.objects.filter(pk=task.pk).update(app_lock=None)
        safe_release_task_locks(task, lock_owner=worker.name)
    for task in got:
        if req["mode"] == "finish":
            Task.objects.filter(pk=task.pk).update(
                state=TASK_STATES.COMPLETED, finished_at=timezone.now()
            )
    return {"ms": took, "fetched": len(got)}


def stop(_: dict) -> dict:
    for worker in workers:
        AppStatus.objects.filter(pk=worker.app_status.pk).delete()
    return {}


OPS = {
    "domain": domain,
    "dispatch": dispatch_tasks,
    "cancel": cancel_waiting,
    "baseline_setup": baseline_setup,
    "baseline_round": baseline_round,
    "stop": stop,
}

print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    request = json.loads(line)
    try:
        answer = OPS[request["op"]](request)
    except Exception as e:  # the bench prints it and stops
        answer = {"error": f"{type(e).__name__}: {e}"}
    connection.close_if_unusable_or_obsolete()
    print(json.dumps(answer), flush=True)
