"""Fixtures: a real broker on throwaway PostgreSQL and Redis (`dispatch-sandbox`), a
database connection to insert tasks and read their state, and certificates for TLS tests."""

from __future__ import annotations

import datetime
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
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

REPO = pathlib.Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "clients" / "python"))


def broker_binary() -> str:
    path = os.environ.get("DISPATCH_BROKER_BIN") or str(REPO / "target" / "debug" / "dispatch-broker")
    if not os.path.exists(path):
        pytest.exit(f"no broker binary at {path}: run `cargo build` first (or set DISPATCH_BROKER_BIN)", 2)
    return path


def sandbox_binary() -> str:
    path = os.environ.get("DISPATCH_SANDBOX_BIN") or str(REPO / "target" / "debug" / "dispatch-sandbox")
    if not os.path.exists(path):
        pytest.exit(
            f"no sandbox binary at {path}: run `cargo build --workspace` first (or set DISPATCH_SANDBOX_BIN)", 2
        )
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
        [sandbox_binary(), *extra],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line:
        raise RuntimeError(f"dispatch-sandbox exited with {process.wait()} before it served")
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


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _ca(cn: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(_name(cn))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _leaf(
    ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey], name: str, server: bool
) -> tuple[bytes, bytes]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    usage = x509.oid.ExtendedKeyUsageOID.SERVER_AUTH if server else x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(ca[0].subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .sign(ca[1], hashes.SHA256())
    )
    return (
        cert.public_bytes(serialization.Encoding.PEM),
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
    )


@dataclass
class Pki:
    """PEM files: a CA, the broker's certificate (for the name "localhost" only: the tests reach
    it at 127.0.0.1, so the name must be given), a worker's client certificate from the same CA,
    and a client certificate from another CA."""

    ca: pathlib.Path
    server_cert: pathlib.Path
    server_key: pathlib.Path
    client_cert: pathlib.Path
    client_key: pathlib.Path
    rogue_ca: pathlib.Path
    rogue_cert: pathlib.Path
    rogue_key: pathlib.Path


def make_pki(d: pathlib.Path) -> Pki:
    """Writes a fresh PKI (see ``Pki``) into ``d``."""
    ca, rogue = _ca("test CA"), _ca("another CA")
    files: dict[str, bytes] = {
        "ca": ca[0].public_bytes(serialization.Encoding.PEM),
        "rogue_ca": rogue[0].public_bytes(serialization.Encoding.PEM),
    }
    files["server_cert"], files["server_key"] = _leaf(ca, "localhost", server=True)
    files["client_cert"], files["client_key"] = _leaf(ca, "worker-1", server=False)
    files["rogue_cert"], files["rogue_key"] = _leaf(rogue, "worker-1", server=False)
    paths = {}
    for name, data in files.items():
        paths[name] = d / f"{name}.pem"
        paths[name].write_bytes(data)
    return Pki(**paths)
