"""TLS for `flows.services` beyond loopback: a certificate, and stunnel in front of both servers.

Neither server terminates TLS itself the same way (Prefect's `server start` has no TLS option), so with
TLS on (`--host` beyond loopback, or `--tls`) both servers listen on 127.0.0.1 only and stunnel (Debian's
`stunnel4`: a TLS terminator and nothing else, one small configuration file for both ports, any TCP
stream passed through, the UI's websockets included) listens on the address asked and forwards to them.
The certificate is the user's (`--tls-cert`/`--tls-key`) or one signed by a CA generated in the services
directory (`tls/ca.pem`; every key 0600): clients trust it through `tls/ca-bundle.pem` (the public CAs
plus ours), which the client environments name in the variables requests, httpx, Prefect and MLflow read.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import certifi
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from flows.services.servers import SERVERS, Launch, probe_host
from flows.services.state import CA_BUNDLE, LOOPBACK, TLS_DIR, Services, ServicesError, write_private
from tasks.network import is_loopback

PROXY = "tls-proxy"
CA_CERT, CA_KEY = "ca.pem", "ca-key.pem"
SERVER_CERT, SERVER_KEY = "server.pem", "server-key.pem"
CERT_DAYS = 397  # what browsers accept for a server certificate
CA_DAYS = 3650


@dataclass(frozen=True)
class TlsOptions:
    """What `up` is asked about TLS. TLS is on beyond loopback, unless `public_urls` name a proxy of the
    user's own in front of the servers (which then terminates it); `tls` turns it on for loopback too. A
    directory that had it keeps it until `up` is given another address."""

    tls: bool = False
    cert: str | None = None  # the user's certificate (chain) and key, PEM
    key: str | None = None
    public_urls: Mapping[str, str] | None = None  # server name -> the URL the user's proxy serves it at

    def apply(self, services: Services, host_given: bool) -> None:
        if bool(self.cert) != bool(self.key):
            raise ServicesError("--tls-cert and --tls-key go together: give both (certificate chain and key)")
        if self.public_urls is not None:
            services.public_urls = {name: _public_url(name, url) for name, url in self.public_urls.items()}
        if self.cert and self.key:
            services.tls_cert, services.tls_key = (
                str(Path(self.cert).resolve()),
                str(Path(self.key).resolve()),
            )
        if services.public_urls and (self.tls or self.cert):
            raise ServicesError(
                "--public-url names a TLS proxy of your own in front of the servers: drop --tls and "
                "--tls-cert (or drop --public-url, and `up` starts one)"
            )
        beyond = not is_loopback(services.host)
        unnamed = [name for name in SERVERS if name not in services.public_urls]
        if services.public_urls and unnamed and beyond:
            raise ServicesError(
                f"--public-url names a proxy for {', '.join(sorted(services.public_urls))} only: "
                f"{', '.join(unnamed)} would listen on {services.host} over plain HTTP, and clients would send "
                "their credentials in clear; give --public-url for each of prefect and mlflow (or drop "
                "--public-url, and `up` puts TLS in front of both)"
            )
        kept = services.tls and not host_given
        services.tls = not services.public_urls and (self.tls or bool(self.cert) or beyond or kept)


def _public_url(name: str, url: str) -> str:
    parts = urlsplit(url)
    if name not in SERVERS or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ServicesError(
            f"--public-url {name}={url}: expected prefect=URL or mlflow=URL, an http(s) URL with a host "
            "(e.g. mlflow=https://mlflow.example.org)"
        )
    if parts.username or parts.password:
        raise ServicesError(f"--public-url {name}: no credentials in the URL; clients get theirs from env.sh")
    if parts.scheme == "http" and not is_loopback(parts.hostname):
        raise ServicesError(
            f"--public-url {name}=http://{parts.hostname}...: clients would send their passwords in clear "
            "over the network; give the https:// URL your proxy serves"
        )
    return url.rstrip("/")


def stunnel() -> str:
    found = shutil.which("stunnel4") or shutil.which("stunnel")
    if found is None:
        raise ServicesError(
            "TLS needs stunnel, which is not installed: `apt-get install stunnel4` (or listen on 127.0.0.1 "
            "only, without --tls)"
        )
    return found


def _name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> str:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()


_CA_USAGE = dict.fromkeys(
    ("digital_signature", "content_commitment", "key_encipherment", "data_encipherment", "key_agreement"),
    False,
) | {"key_cert_sign": True, "crl_sign": True, "encipher_only": False, "decipher_only": False}


def _subtree(host: str) -> x509.GeneralName:
    name = _name(host)
    if isinstance(name, x509.IPAddress):  # a constraint names a network: this one address
        return x509.IPAddress(ipaddress.ip_network(name.value))
    return name


def _permits(cert: x509.Certificate, names: list[str]) -> bool:
    """Whether the CA's name constraints cover every one of `names` (False: it has none)."""
    try:
        constraints = cert.extensions.get_extension_for_class(x509.NameConstraints).value
    except x509.ExtensionNotFound:
        return False
    return {_subtree(n) for n in names} <= set(constraints.permitted_subtrees or ())


def _ca(folder: Path, names: list[str]) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """The directory's CA: its certificate and key. It may vouch for the servers' `names` only (name
    constraints: clients that trust it trust nothing else it could sign); made again when the names grow
    beyond it, or when an older one has no constraints (clients elsewhere then need the new bundle)."""

    if (folder / CA_CERT).is_file() and (folder / CA_KEY).is_file():
        cert = x509.load_pem_x509_certificate((folder / CA_CERT).read_bytes())
        key = serialization.load_pem_private_key((folder / CA_KEY).read_bytes(), None)
        assert isinstance(key, ec.EllipticCurvePrivateKey)  # the one _ca wrote
        if _permits(cert, names):
            return cert, key
    key = ec.generate_private_key(ec.SECP256R1())
    # A common name is at most 64 characters: the directory by a digest of its path.
    which = hashlib.sha256(str(folder.parent).encode()).hexdigest()[:16]
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"llamaflow services CA {which}")])
    now = datetime.datetime.now(datetime.UTC)
    permitted = list(dict.fromkeys(_subtree(n) for n in names))
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(**_CA_USAGE), critical=True)
        .add_extension(
            x509.NameConstraints(permitted_subtrees=permitted, excluded_subtrees=None), critical=True
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    write_private(folder / CA_KEY, _key_pem(key))
    write_private(folder / CA_CERT, cert.public_bytes(serialization.Encoding.PEM).decode())
    return cert, key


def _server_names(services: Services) -> list[str]:
    names = [services.public_host, services.host, "localhost", LOOPBACK]
    return list(dict.fromkeys(n for n in names if n not in ("0.0.0.0", "::", "")))


def _issue(folder: Path, names: list[str]) -> None:
    """A server certificate for `names`, signed by the directory's CA (kept while its names still fit)."""

    ca_cert, ca_key = _ca(folder, names)
    wanted = [_name(n) for n in names]
    if (folder / SERVER_CERT).is_file():
        kept = x509.load_pem_x509_certificate((folder / SERVER_CERT).read_bytes())
        sans = kept.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        left = kept.not_valid_after_utc - datetime.datetime.now(datetime.UTC)
        try:
            kept.verify_directly_issued_by(ca_cert)  # not by a CA made again since
            ours = True
        except (ValueError, TypeError, InvalidSignature):
            ours = False
        if ours and set(sans) == set(wanted) and left > datetime.timedelta(days=30):
            return
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0][:64])]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
        .add_extension(x509.SubjectAlternativeName(wanted), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    write_private(folder / SERVER_KEY, _key_pem(key))
    write_private(folder / SERVER_CERT, cert.public_bytes(serialization.Encoding.PEM).decode())


def prepare(services: Services) -> tuple[Path, Path]:
    """The certificate and key the proxy serves: the user's, or one from the directory's CA (made or
    renewed here, with the client bundle). Returns their paths."""
    if services.tls_cert:
        cert, key = Path(services.tls_cert), Path(services.tls_key)
        for path, flag in ((cert, "--tls-cert"), (key, "--tls-key")):
            if not path.is_file():
                raise ServicesError(f"{flag} {path}: no such file; give the PEM file's path")
        return cert, key
    folder = Path(services.root) / TLS_DIR
    folder.mkdir(mode=0o700, exist_ok=True)
    _issue(folder, _server_names(services))
    public = Path(certifi.where()).read_text()
    write_private(folder / CA_BUNDLE, public.rstrip("\n") + "\n" + (folder / CA_CERT).read_text())
    return folder / SERVER_CERT, folder / SERVER_KEY


def _accept(host: str, port: int) -> str:
    return f":::{port}" if host == "::" else f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def proxy_launch(services: Services) -> Launch:
    """stunnel in the foreground: one service a server, from its public port on `services.host` to the
    server on loopback. The certificate's digest is in the configuration, so a new one restarts it."""
    root = Path(services.root)
    cert, key = prepare(services)
    digest = hashlib.sha256(cert.read_bytes()).hexdigest()
    lines = [f"; certificate sha256 {digest}", "foreground = yes", "pid =", "debug = notice"]
    for name, backend in (("prefect", services.prefect_port), ("mlflow", services.mlflow_port)):
        lines += [
            f"[{name}]",
            f"accept = {_accept(services.host, services.proxy_ports[name])}",
            f"connect = {LOOPBACK}:{backend}",
            f"cert = {cert}",
            f"key = {key}",
            "sslVersionMin = TLSv1.2",
        ]
    config = root / "stunnel.conf"
    health = f"https://{probe_host(services.host)}:{services.proxy_ports['mlflow']}/health"
    text = "\n".join(lines) + "\n"
    return Launch([stunnel(), str(config)], {}, {}, health, root / "stunnel.log", config, text)
