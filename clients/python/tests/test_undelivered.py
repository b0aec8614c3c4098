"""The worker's bookkeeping of undelivered grants (``_Undelivered``), on its own: which grants it
hands back, when, and which late answers it refuses. The same cases as the Rust library's unit
tests; ``test_worker.py`` shows it against a real broker."""

from __future__ import annotations

import time

from dispatch_broker_client._proto import broker_pb2 as pb
from dispatch_broker_client.worker import _HAND_BACK_AT_ONCE, _Undelivered


def held(task_id: str, token: int) -> pb.HeldTask:
    return pb.HeldTask(task_id=task_id, fencing_token=token)


def keys(tasks: list[pb.HeldTask]) -> list[tuple[str, int]]:
    return [(h.task_id, h.fencing_token) for h in tasks]


def test_a_grant_never_received_is_due_after_two_heartbeats_in_a_row() -> None:
    u = _Undelivered()
    sent = time.monotonic()
    u.listed([held("a", 7)], 1, sent)
    assert u.due_now(1) == [], "once is not enough"
    u.listed([held("a", 7)], 1, sent)
    assert keys(u.due_now(1)) == [("a", 7)]
    # Handed back: an answer bringing it after all is not run; the broker took it.
    assert not u.note_received("a", 7)
    u.reported([held("a", 7)])
    assert u.due_now(1) == []
    # Granted again (a new token), it is a grant like any other.
    assert u.note_received("a", 9)


def test_an_answer_that_arrives_before_the_hand_back_takes_the_grant_off_the_list() -> None:
    u = _Undelivered()
    sent = time.monotonic()
    u.listed([held("a", 7)], 1, sent)
    u.listed([held("a", 7)], 1, sent)
    assert u.note_received("a", 7), "it arrived: it runs here"
    assert u.due_now(1) == [], "so it is not handed back"
    u.listed([held("a", 7)], 1, sent)
    assert u.due_now(1) == []


def test_a_grant_handed_back_goes_again_while_it_is_listed() -> None:
    u = _Undelivered()
    sent = time.monotonic()
    u.listed([held("a", 7)], 1, sent)
    u.listed([held("a", 7)], 1, sent)
    u.reported(u.due_now(1))
    # The broker did not act on it (a replica killed after answering): still listed.
    u.listed([held("a", 7)], 1, sent)
    assert keys(u.due_now(1)) == [("a", 7)]
    # Acted on: no longer listed, nothing more to hand back.
    u.reported([held("a", 7)])
    u.listed([], 1, sent)
    assert u.due_now(1) == []


def test_a_task_adopted_after_a_rebuild_is_due_unless_the_worker_still_has_it() -> None:
    u = _Undelivered()
    assert u.note_received("a", 7)
    assert u.note_received("b", 8)
    # The reopen: "a" is still held (or being let go), so it is received under its new token;
    # "b" was received before but the worker no longer has it (its task lost).
    assert u.note_received("a", 12)
    sent = time.monotonic()
    u.listed([held("a", 12), held("b", 13)], 2, sent)
    u.listed([held("a", 12), held("b", 13)], 2, sent)
    assert keys(u.due_now(2)) == [("b", 13)], "only the one never received"


def test_received_grants_are_never_due() -> None:
    u = _Undelivered()
    assert u.note_received("a", 7)
    sent = time.monotonic()
    for _ in range(3):
        u.listed([held("a", 7)], 1, sent)
    assert u.due_now(1) == []
    # Let go (not listed by a heartbeat sent after it arrived), then listed again under another
    # token that never arrived: that one is due.
    u.listed([], 1, time.monotonic())
    assert u.received == {}, "a grant let go is forgotten"
    u.listed([held("a", 8)], 1, sent)
    u.listed([held("a", 8)], 1, sent)
    assert keys(u.due_now(1)) == [("a", 8)]


def test_a_grant_of_an_earlier_lease_is_not_handed_back_with_the_new_one() -> None:
    u = _Undelivered()
    sent = time.monotonic()
    u.listed([held("a", 7)], 1, sent)
    u.listed([held("a", 7)], 1, sent)
    # The lease was reopened (generation 2) before the heartbeat that would hand it back.
    assert u.due_now(2) == []


def test_at_most_a_hundred_go_back_with_one_heartbeat() -> None:
    u = _Undelivered()
    sent = time.monotonic()
    many = [held(f"t{n}", n + 1) for n in range(_HAND_BACK_AT_ONCE + 20)]
    u.listed(many, 1, sent)
    u.listed(many, 1, sent)
    first = u.due_now(1)
    assert len(first) == _HAND_BACK_AT_ONCE
    u.reported(first)
    rest = u.due_now(1)
    assert len(rest) == 20
    assert not set(keys(first)) & set(keys(rest))
