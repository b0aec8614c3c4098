"""TLS and mutual TLS between the Python client (and pulpcore-broker-worker's options) and a real
broker, with certificates made in the test, as tests/it/security.rs does for Rust."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import grpc
import pytest

from conftest import Db, Pki, Sandbox, make_pki, start_sandbox, stop_sandbox
from dispatch_broker_client import BrokerError, RetryPolicy, TlsConfig, Worker
from dispatch_broker_client.pulp import parse_args, tls_from_env

# A failed handshake is UNAVAILABLE, which the client would retry for a minute.
NO_RETRY = RetryPolicy(max_elapsed=0)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_broker(pki: Pki) -> Iterator[Sandbox]:
    box = start_sandbox("--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key))
    yield box
    stop_sandbox(box)


@pytest.fixture(scope="module")
def mtls_broker(pki: Pki) -> Iterator[Sandbox]:
    box = start_sandbox(
        "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key), "--tls-client-ca", str(pki.ca)
    )
    yield box
    stop_sandbox(box)


def leases(box: Sandbox) -> int:
    db = Db(box.postgres_url)
    try:
        row = db.conn.execute("SELECT count(*) FROM core_appstatus").fetchone()
        assert row is not None
        return int(row[0])
    finally:
        db.conn.close()


def runs_a_task(box: Sandbox, w: Worker, resource: str) -> None:
    db = Db(box.postgres_url)
    try:
        task_id = db.task(resource)
        with w:
            task = w.fetch()
            assert task is not None and task.task_id == task_id
            task.start()
            assert task.finish("completed") == "completed"
        assert db.state(task_id) == "completed"
    finally:
        db.conn.close()


def refused(w: Worker) -> BrokerError:
    with pytest.raises(BrokerError) as refused:
        w.open()
    w.close()
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE, refused.value
    return refused.value


def test_tls_with_the_ca_and_the_server_name_runs_tasks(tls_broker: Sandbox, pki: Pki, resource: str) -> None:
    tls = TlsConfig.from_files(ca=pki.ca, domain="localhost")
    runs_a_task(tls_broker, Worker(tls_broker.address, "tls-worker", tls=tls), resource)


def test_tls_refuses_plaintext_another_ca_and_a_name_the_certificate_lacks(tls_broker: Sandbox, pki: Pki) -> None:
    before = leases(tls_broker)
    refused(Worker(tls_broker.address, "plain", retry=NO_RETRY))
    refused(Worker(tls_broker.address, "rogue", retry=NO_RETRY, tls=TlsConfig.from_files(pki.rogue_ca, "localhost")))
    # The certificate names "localhost", not the address the worker dials.
    refused(Worker(tls_broker.address, "unnamed", retry=NO_RETRY, tls=TlsConfig.from_files(pki.ca)))
    assert leases(tls_broker) == before, "no refused worker got a lease"


def test_mutual_tls_needs_a_client_certificate_from_the_ca(mtls_broker: Sandbox, pki: Pki, resource: str) -> None:
    before = leases(mtls_broker)
    refused(Worker(mtls_broker.address, "anonymous", retry=NO_RETRY, tls=TlsConfig.from_files(pki.ca, "localhost")))
    rogue = TlsConfig.from_files(pki.ca, "localhost", cert=pki.rogue_cert, key=pki.rogue_key)
    refused(Worker(mtls_broker.address, "rogue", retry=NO_RETRY, tls=rogue))
    assert leases(mtls_broker) == before, "no refused worker got a lease"
    tls = TlsConfig.from_files(pki.ca, "localhost", cert=pki.client_cert, key=pki.client_key)
    runs_a_task(mtls_broker, Worker(mtls_broker.address, "mtls-worker", tls=tls), resource)


def test_the_worker_command_options_and_variables_connect_with_mutual_tls(
    mtls_broker: Sandbox, pki: Pki, resource: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # pulpcore-broker-worker's options ...
    args = parse_args(
        [
            "--broker", mtls_broker.address, "--tls-ca", str(pki.ca), "--tls-domain", "localhost",
            "--tls-cert", str(pki.client_cert), "--tls-key", str(pki.client_key),
        ]
    )
    runs_a_task(mtls_broker, Worker(args.broker, "cli-options", tls=args.tls), resource)
    # ... and the same through DISPATCH_BROKER_* variables, which claim_immediate_tasks's
    # tls_from_env() reads too.
    monkeypatch.setenv("DISPATCH_BROKER_ADDRESS", mtls_broker.address)
    monkeypatch.setenv("DISPATCH_BROKER_TLS_CA", str(pki.ca))
    monkeypatch.setenv("DISPATCH_BROKER_TLS_DOMAIN", "localhost")
    monkeypatch.setenv("DISPATCH_BROKER_TLS_CERT", str(pki.client_cert))
    monkeypatch.setenv("DISPATCH_BROKER_TLS_KEY", str(pki.client_key))
    args = parse_args([])
    assert args.tls == tls_from_env()
    runs_a_task(mtls_broker, Worker(args.broker, "cli-env", tls=args.tls), resource)


def test_the_worker_command_refuses_bad_tls_options_with_one_line(
    pki: Pki, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert parse_args(["--broker", "h:1"]).tls is None, "plaintext unless asked"
    assert parse_args(["--broker", "https://h:1"]).tls == TlsConfig(), "https://: the system's CAs"
    for argv, said in [
        (["--tls-cert", str(pki.client_cert)], "--tls-cert and --tls-key"),
        (["--tls-ca", str(tmp_path / "missing.pem")], "cannot read --tls-ca (DISPATCH_BROKER_TLS_CA)"),
    ]:
        with pytest.raises(SystemExit) as exit:
            parse_args(argv)
        assert exit.value.code == 2
        assert said in capsys.readouterr().err
    with pytest.raises(ValueError, match="needs its private key"):
        TlsConfig(cert=b"x")
