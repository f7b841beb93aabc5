"""The rules of `flows.services` that need no server (seconds): the MLflow policy's verdicts on crafted
requests (one reading of every request, promoters-only routes, readers' exact routes, a missing roles file
failing closed) and what `configure` refuses before anything starts (user names, a partial --public-url
beyond loopback, --no-auth reached from beyond loopback, a --host this machine cannot listen on). The same
policy against the real servers, in raw HTTP: tests/test_services_policy.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flows import services as stores
from flows.services import mlflow_policy as policy
from flows.services.state import ServicesError
from flows.services.tls import TlsOptions

JSON = "application/json"
API = "/api/2.0/mlflow"


@pytest.fixture()
def roles_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "mlflow-roles.json"
    path.write_text(json.dumps({"promoters": ["admin", "promoter"], "readers": ["reader"]}))
    monkeypatch.setenv(policy.ROLES_VARIABLE, str(path))
    monkeypatch.setenv("MLFLOW_AUTH_ADMIN_USERNAME", "admin")
    return path


def test_a_request_that_could_be_read_two_ways_is_refused() -> None:
    body = json.dumps({"name": "m", "version": "1"}).encode()
    delete = f"{API}/model-versions/delete"
    two_ways = {
        "text/plain body": ("DELETE", delete, "text/plain", body, False),
        "no Content-Type": ("DELETE", delete, None, body, False),
        "form body": ("POST", f"{API}/runs/create", "application/x-www-form-urlencoded", b"a=1", False),
        "query and JSON body": ("DELETE", delete, JSON, body, True),
        "query and body on a GET": ("GET", f"{API}/runs/get", JSON, body, True),
        "JSON that is no object": ("POST", f"{API}/runs/create", JSON, b"[1]", False),
        "JSON that does not parse": ("POST", f"{API}/runs/create", JSON, b"{", False),
    }
    assert [what for what, args in two_ways.items() if policy.one_reading(*args) is None] == []
    one_way = {
        "JSON as JSON": ("DELETE", delete, JSON, body, False),
        "JSON with a charset": ("POST", f"{API}/runs/create", "application/json; charset=utf-8", body, False),
        "the query alone": ("DELETE", delete, None, b"", True),
        "an artifact upload's bytes": (
            "PUT",
            "/api/2.0/mlflow-artifacts/artifacts/1/r/artifacts/x.bin",
            "application/octet-stream",
            b"\x00",
            False,
        ),
    }
    assert {what: policy.one_reading(*args) for what, args in one_way.items()} == dict.fromkeys(one_way)


def test_registry_deletes_renames_stages_and_locks_are_the_promoters(roles_file: Path) -> None:
    writes = {
        "delete a version": ("DELETE", f"{API}/model-versions/delete", {"name": "m", "version": "1"}),
        "delete a model": ("DELETE", f"{API}/registered-models/delete", {"name": "m"}),
        "delete a version tag": ("DELETE", f"{API}/model-versions/delete-tag", {"name": "m", "key": "k"}),
        "delete a model tag": ("DELETE", f"{API}/registered-models/delete-tag", {"name": "m", "key": "k"}),
        "rename": ("POST", f"{API}/registered-models/rename", {"name": "m", "new_name": "n"}),
        "transition": ("POST", f"{API}/model-versions/transition-stage", {"name": "m", "stage": "Archived"}),
        "create a lock": ("POST", f"{API}/registered-models/create", {"name": "m.promotion-lock"}),
        "take a ticket": ("POST", f"{API}/model-versions/create", {"name": "m.promotion-lock"}),
        "move an alias": ("POST", f"{API}/registered-models/alias", {"name": "m", "alias": "champion"}),
    }
    assert [what for what, args in writes.items() if policy.allowed("worker", *args)] == []
    assert [what for what, args in writes.items() if not policy.allowed("promoter", *args)] == []
    assert policy.allowed("worker", "POST", f"{API}/model-versions/set-tag", {"name": "m", "key": "note"})


def test_readers_get_exactly_the_read_routes(roles_file: Path) -> None:
    reads = [
        ("GET", f"{API}/registered-models/get", {}),
        ("POST", f"{API}/runs/search", {}),
        ("POST", "/ajax-api/2.0/mlflow/experiments/search-datasets", {}),
        ("POST", f"{API}/registered-models/get-latest-versions", {}),
        ("POST", "/api/3.0/mlflow/traces/search", {}),
    ]
    writes = [
        ("POST", "/api/3.0/mlflow/review-queues/get-or-create-user", {}),
        ("POST", "/graphql", {}),
        ("POST", f"{API}/runs/create", {}),
        ("PATCH", f"{API}/logged-models/m-0", {}),
    ]
    assert [r for r in reads if not policy.allowed("reader", *r)] == []
    assert [w for w in writes if policy.allowed("reader", *w)] == []


def test_a_missing_roles_file_fails_closed(roles_file: Path) -> None:
    roles_file.unlink()
    create = ("POST", f"{API}/runs/create", {})
    assert not policy.allowed("worker", *create) and not policy.allowed("promoter", *create)
    assert policy.allowed("worker", "GET", f"{API}/runs/get", {})
    assert policy.allowed("admin", *create)
    assert policy.allowed("admin", "POST", f"{API}/registered-models/alias", {"name": "m"})


@pytest.mark.parametrize("name", ["../../x", "a/b", ".hidden", "", "x" * 65, "a..b", "w s"])
def test_a_user_name_that_is_no_plain_file_name_is_refused(tmp_path: Path, name: str) -> None:
    services, _ = stores.configure(tmp_path / "stores", pg_user="daemon")
    with pytest.raises(ServicesError, match="user name"):
        stores.add_user(services, name)
    assert not (tmp_path / "x.env").exists() and not list(tmp_path.glob("**/*.env"))


def test_a_partial_public_url_beyond_loopback_is_refused(tmp_path: Path) -> None:
    only_mlflow = TlsOptions(public_urls={"mlflow": "https://mlflow.example.org"})
    with pytest.raises(ServicesError, match="prefect would listen on 0.0.0.0 over plain HTTP"):
        stores.configure(tmp_path / "a", host="0.0.0.0", tls_options=only_mlflow)
    both = TlsOptions(public_urls={"mlflow": "https://m.example.org", "prefect": "https://p.example.org"})
    services, _ = stores.configure(tmp_path / "b", host="0.0.0.0", tls_options=both)
    assert not services.tls
    local, _ = stores.configure(tmp_path / "c", tls_options=only_mlflow)  # the other stays on loopback
    assert local.prefect_api_url.startswith("http://127.0.0.1:")


def test_no_auth_reached_from_beyond_loopback_is_refused(tmp_path: Path) -> None:
    proxy = TlsOptions(public_urls={"mlflow": "https://m.example.org", "prefect": "https://p.example.org"})
    with pytest.raises(ServicesError, match="--no-auth with clients reaching the stores at https://"):
        stores.configure(tmp_path / "a", no_auth=True, tls_options=proxy)
    with pytest.raises(ServicesError, match="--no-auth"):
        stores.configure(tmp_path / "b", no_auth=True, public_host="stores.example.org")


def test_a_host_this_machine_cannot_listen_on_is_named_with_the_fix(tmp_path: Path) -> None:
    fix = r"--host 198\.19\.255\.254: this machine cannot listen there .*0\.0\.0\.0"
    with pytest.raises(ServicesError, match=fix):  # TLS: stunnel would listen there
        stores.configure(tmp_path / "a", host="198.19.255.254")  # on no interface of this machine
    own = TlsOptions(public_urls={"mlflow": "https://m.example.org", "prefect": "https://p.example.org"})
    with pytest.raises(ServicesError, match=fix):  # the servers would, behind the user's proxy
        stores.up(tmp_path / "b", host="198.19.255.254", tls_options=own, pg_user="daemon")
    assert not (tmp_path / "b" / "postgres").exists()  # refused before anything started


def test_writes_from_a_web_page_of_another_origin_are_refused(
    roles_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLflow lets any http://localhost:* page write; the policy only the server's own public origin."""
    from flask import Flask

    monkeypatch.setenv(policy.ORIGIN_VARIABLE, "https://stores.example.org:443")
    app = Flask(__name__)

    def refusal(method: str, origin: str | None, **kwargs) -> str | None:
        headers = {"Origin": origin} if origin else {}
        with app.test_request_context(f"{API}/runs/create", method=method, headers=headers, **kwargs):
            return policy._refusal("worker")

    for origin in (
        "http://localhost:5000",
        "https://stores.example.org:8443",
        "null",
        "https://evil.example",
    ):
        assert "may not change anything here" in (refusal("POST", origin, json={}) or ""), origin
    assert refusal("POST", "https://stores.example.org", json={}) is None  # the default port, left out
    assert refusal("POST", None, json={}) is None  # not a browser
    assert refusal("GET", "http://localhost:5000") is None  # reads are CORS's business
    assert "JSON" in (refusal("POST", None, data="{}", content_type="text/plain") or "")


def test_the_directorys_ca_vouches_for_the_servers_names_only(tmp_path: Path) -> None:
    """Clients trust the CA for these servers: name constraints keep a leaked CA key from vouching for
    any other site to them; new names make a new CA."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.verification import PolicyBuilder, Store, VerificationError

    from flows.services import tls

    services, _ = stores.configure(tmp_path / "s", tls_options=TlsOptions(tls=True))
    cert_path, _ = tls.prepare(services)
    folder = cert_path.parent
    ca = x509.load_pem_x509_certificate((folder / tls.CA_CERT).read_bytes())
    leaf = x509.load_pem_x509_certificate(cert_path.read_bytes())

    def verifies(cert: x509.Certificate, name: x509.DNSName | x509.IPAddress) -> bool:
        verifier = PolicyBuilder().store(Store([ca])).build_server_verifier(name)
        try:
            verifier.verify(cert, [])
        except VerificationError:
            return False
        return True

    import ipaddress

    assert verifies(leaf, x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
    constraints = ca.extensions.get_extension_for_class(x509.NameConstraints).value
    assert set(constraints.permitted_subtrees) == {
        x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_network("127.0.0.1/32")),
    }
    # what the CA's key could sign for another site: refused by every client trusting the bundle
    from cryptography.hazmat.primitives import serialization

    ca_key = serialization.load_pem_private_key((folder / tls.CA_KEY).read_bytes(), None)
    now = datetime.datetime.now(datetime.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    forged = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("bank.example")]), critical=True)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    assert not verifies(forged, x509.DNSName("bank.example"))
    # another public name: a new CA for the new names, and a server certificate it signed
    services.public_host = "stores.example.org"
    tls.prepare(services)
    again = x509.load_pem_x509_certificate((folder / tls.CA_CERT).read_bytes())
    assert again != ca
    ca = again
    assert verifies(
        x509.load_pem_x509_certificate(cert_path.read_bytes()), x509.DNSName("stores.example.org")
    )
