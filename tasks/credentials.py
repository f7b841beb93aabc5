"""Credentials never travel inside a URI: taken out at the door, redacted at every boundary.

A store given with its credentials inside (`MLFLOW_TRACKING_URI=https://alice:PW@host`,
`PREFECT_API_URL=https://admin:PW@host/api`, `postgresql://llama:PW@db/mlflow`) works, but the libraries echo
their URIs: MLflow prints "View run ... at: <uri>" and quotes the URL of a failed request in its exceptions,
Prefect logs "View at <ui url>" and derives the flow-run URLs we tag runs with from its API URL. So every
entry point calls `guard_credentials()` first. It moves the credentials into the variables each client reads
for them, and leaves the URIs without them, for this process and every process it starts:

    MLFLOW_TRACKING_URI, MLFLOW_REGISTRY_URI = http(s)://USER:PW@...
        -> MLFLOW_TRACKING_USERNAME, MLFLOW_TRACKING_PASSWORD
    MLFLOW_TRACKING_URI, MLFLOW_REGISTRY_URI = postgresql://USER:PW@...
        -> PGPASSWORD (libpq and asyncpg read it; the user name stays in the URI)
    PREFECT_API_URL = http(s)://USER:PW@...  -> PREFECT_API_AUTH_STRING ("USER:PW")
    PREFECT_UI_URL = http(s)://USER:PW@...   -> (dropped: a UI address needs none)

Every secret it moved or found in those variables is remembered: `redact` replaces them, and the user-info of
any URI, in text that is shown or stored (messages, MLflow params and tags, log records).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import threading
import urllib.parse
from collections.abc import MutableMapping

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
_TOKEN_END = re.compile(r"[\s'\"<>`]")
# Query parameters that carry a secret (libpq's `password`, an API's `token`): their values are hidden.
_SECRET_PARAMETER = re.compile(
    r"([?&](?:password|passwd|pwd|sslpassword|token|access_token|api_key|apikey|secret)=)[^&#\s'\"<>`]*",
    re.IGNORECASE,
)
# Where the client libraries take a password from instead of the URI.
_LIBPQ_SCHEMES = ("postgresql", "postgres", "postgresql+psycopg", "postgresql+psycopg2", "postgresql+asyncpg")
# Variables that hold a secret themselves: remembered so that `redact` hides their values.
SECRET_VARIABLES = (
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN",
    "PREFECT_API_AUTH_STRING",
    "PREFECT_API_KEY",
    "PGPASSWORD",
)
# Where `take_out` puts what it moved.
_CLIENT_VARIABLES = (
    "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD",
    "PGPASSWORD",
    "PREFECT_API_AUTH_STRING",
)
_MIN_SECRET = 4  # shorter values would blank out ordinary words; such a password is no secret anyway
_SECRETS: set[str] = set()
_LOCK = threading.Lock()
_LOG_REDACTION = False


class CredentialsError(ValueError):
    """Credentials were given in a way that cannot be taken out of the URI safely."""


# ------------------------------------------------------------------------------------------ redaction


def _is_host_port(head: str) -> bool:
    """Whether an authority without `@` (`head`, up to the first `/`, `?` or `#`) reads as host:port, not
    as user:password. A password of digits cut by a `/` (`alice:2024/x@host`) reads as a port to URL
    parsers (and as user-info to SQLAlchemy): it counts as a port only after a name that is clearly a
    host (an IP address, a dotted name, `localhost`)."""
    if head.startswith("["):
        return True
    host, _, port = head.rpartition(":")
    if not port.isdigit():
        return False
    if host == "localhost" or "." in host:
        return True
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _userinfo_end(rest: str, line: str | None = None) -> int | None:
    """Index of the `@` that ends the user-info of `rest` (a URI after `scheme://`), or None.

    Parsers disagree on passwords holding `@`, `/` or `:` unencoded (browsers split at the authority's last
    `@`, SQLAlchemy at the first `@` even past a `/`), and people type them: when the authority starts as
    `user:something` (not `host:port`), the user-info runs to the last `@` of the URI, so no part of such a
    password is ever shown (a path holding `@` is hidden with it). `line`: the text from the same start to
    the end of its line, where a URI found in text may go on (a password holding a space, a quote, `<` or
    `>` ends the URI's token early). A lone user or token ends at the authority's last `@`.
    """
    line = rest if line is None else line
    ends = [i for i in (rest.find(c) for c in "/?#") if i >= 0]
    head = rest[: min(ends, default=len(rest))]
    first_at = head.find("@")
    user = head if first_at < 0 else head[:first_at]
    if ":" in user and not (first_at < 0 and _is_host_port(head)):
        at = line.rfind("@")
        return at if at >= 0 else None
    return head.rfind("@") if first_at >= 0 else None


def _shown(userinfo: str) -> str:
    user, sep, _ = userinfo.partition(":")
    return f"{user}:***" if sep else "***"


def _redact_query(text: str) -> str:
    return _SECRET_PARAMETER.sub(r"\1***", text)


def redact_uri(uri: str) -> str:
    """`uri` with the password (or a lone token) of its user-info, and the value of a secret query
    parameter (`?password=`), replaced by `***`: safe to show."""
    match = _SCHEME.match(uri)
    if match is None:
        return uri
    rest = uri[match.end() :]
    end = _userinfo_end(rest)
    if end is not None:
        uri = f"{match.group()}{_shown(rest[:end])}@{rest[end + 1 :]}"
    return _redact_query(uri)


def redact(text: str) -> str:
    """`text` with the user-info and secret query parameters of every URI in it and every remembered
    secret replaced by `***`."""
    if not text:
        return text
    if "://" in text:
        parts, last = [], 0
        for match in _SCHEME.finditer(text):
            if match.start() < last:
                continue
            start = match.end()
            line_end = text.find("\n", start)
            line_end = len(text) if line_end < 0 else line_end
            following = _SCHEME.search(text, start, line_end)
            limit = following.start() if following else line_end  # the next URI starts its own
            stop = _TOKEN_END.search(text, start, limit)
            token_end = stop.start() if stop else limit
            end = _userinfo_end(text[start:token_end], text[start:limit])
            parts.append(text[last : match.start()])
            if end is None:
                parts.append(text[match.start() : token_end])
                last = token_end
            else:
                parts.append(f"{match.group()}{_shown(text[start : start + end])}@")
                last = start + end + 1
        text = "".join(parts) + text[last:]
    text = _redact_query(text)
    with _LOCK:
        secrets = sorted(_SECRETS, key=len, reverse=True)
    for secret in secrets:
        text = text.replace(secret, "***")
    return text


def remember_secret(value: str | None) -> None:
    """Hide `value` (and its URL-encoded form) in everything `redact` sees from now on."""
    if not value or len(value) < _MIN_SECRET:
        return
    with _LOCK:
        _SECRETS.add(value)
        for encoded in (urllib.parse.quote(value, safe=""), urllib.parse.quote_plus(value, safe="")):
            if encoded != value:
                _SECRETS.add(encoded)  # as a URI or a form encodes it


# ------------------------------------------------------------------------------------------ the door


def split_userinfo(uri: str) -> tuple[str, str | None, str | None]:
    """(`uri` without user-info, user, password), both decoded; (uri, None, None) when it has none."""
    match = _SCHEME.match(uri)
    if match is None:
        return uri, None, None
    rest = uri[match.end() :]
    end = _userinfo_end(rest)
    if end is None:
        return uri, None, None
    user, sep, password = rest[:end].partition(":")
    clean = f"{match.group()}{rest[end + 1 :]}"
    return clean, urllib.parse.unquote(user) or None, (urllib.parse.unquote(password) if sep else None)


def _set(environ: MutableMapping[str, str], name: str, value: str, source: str) -> None:
    """Set `name` to `value` unless it already holds another value: two credentials for one client."""
    current = environ.get(name)
    if current and current != value:
        raise CredentialsError(
            f"{source} carries credentials and {name} is set to other ones: keep one of them (preferably "
            f"{name}, with {source} holding no credentials)"
        )
    environ[name] = value


def _without_query_password(uri: str) -> tuple[str, str | None]:
    """(`uri` without libpq's `password` query parameter, its decoded value or None)."""
    base, sep, query = uri.partition("?")
    if not sep:
        return uri, None
    query, hash_sep, fragment = query.partition("#")
    kept, found = [], None
    for pair in query.split("&"):
        key, _, value = pair.partition("=")
        if key.lower() == "password":
            found = urllib.parse.unquote_plus(value)
        else:
            kept.append(pair)
    if found is None:
        return uri, None
    rebuilt = base + (f"?{'&'.join(kept)}" if kept else "")
    return rebuilt + (f"#{fragment}" if hash_sep else ""), found


def _scheme(uri: str) -> str:
    return urllib.parse.urlsplit(uri).scheme.lower()


def take_out(name: str, environ: MutableMapping[str, str] | None = None) -> bool:
    """Move the credentials of the URI in variable `name` into its client's variables; True if it had any."""
    environ = os.environ if environ is None else environ
    uri = environ.get(name)
    if not uri:
        return False
    clean, user, password = split_userinfo(uri)
    scheme = _scheme(uri)
    if scheme in _LIBPQ_SCHEMES:
        clean, in_query = _without_query_password(clean)
        if in_query is not None and password is not None and in_query != password:
            raise CredentialsError(f"{name} carries two different passwords: keep one (better: PGPASSWORD)")
        password = password if password is not None else in_query
    if clean == uri:
        return False
    remember_secret(password)
    if name == "PREFECT_UI_URL":
        pass
    elif name == "PREFECT_API_URL":
        auth = f"{user or ''}:{password or ''}"
        remember_secret(auth)
        _set(environ, "PREFECT_API_AUTH_STRING", auth, name)
    elif scheme in ("http", "https"):
        if password is None:
            raise CredentialsError(
                f"{name} carries a credential without a password ({redact_uri(uri)}): put a bearer token in "
                "MLFLOW_TRACKING_TOKEN, or a user and password in MLFLOW_TRACKING_USERNAME and "
                f"MLFLOW_TRACKING_PASSWORD, and {name} without them"
            )
        _set(environ, "MLFLOW_TRACKING_USERNAME", user or "", name)
        _set(environ, "MLFLOW_TRACKING_PASSWORD", password, name)
    elif scheme in _LIBPQ_SCHEMES:
        if password is None:
            return False  # a user name alone is no secret: the URI stays as it is
        _set(environ, "PGPASSWORD", password, name)
        match = _SCHEME.match(clean)
        assert match is not None
        if user:
            clean = f"{match.group()}{urllib.parse.quote(user, safe='')}@{clean[match.end() :]}"
    else:
        return False  # a driver that reads its password only from the URI: redacted wherever it is shown
    environ[name] = clean
    return True


def clean_uri(uri: str, variable: str = "MLFLOW_TRACKING_URI") -> str:
    """`uri` (as `variable` would hold it) with its credentials moved into this process's environment."""
    scratch = {key: os.environ[key] for key in _CLIENT_VARIABLES if key in os.environ}
    scratch[variable] = uri
    if not take_out(variable, scratch):
        return uri
    for key, value in scratch.items():
        if key != variable or os.environ.get(variable) == uri:  # the environment's own URI is cleaned too
            os.environ[key] = value
    return scratch[variable]


def guard_credentials(environ: MutableMapping[str, str] | None = None) -> None:
    """What every entry point calls first: take credentials out of the store URIs of this process's
    environment (see the module's docstring), remember every secret, and redact them from log records.
    Idempotent; raises CredentialsError (a message without the secret) on conflicting credentials."""
    environ = os.environ if environ is None else environ
    prefect_changed = False
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI", "PREFECT_API_URL", "PREFECT_UI_URL"):
        if take_out(name, environ):
            prefect_changed |= name.startswith("PREFECT_")
    for name in SECRET_VARIABLES:
        value = environ.get(name)
        remember_secret(value)
        if name == "PREFECT_API_AUTH_STRING" and value:
            remember_secret(value.partition(":")[2])
    if prefect_changed and environ is os.environ:
        _refresh_prefect_settings()
    install_log_redaction()


def _refresh_prefect_settings() -> None:
    """Prefect reads its settings when it is imported: let an already imported Prefect see the clean URL."""
    import sys

    context = sys.modules.get("prefect.context")
    if context is not None:
        context.refresh_global_settings_context()


def install_log_redaction() -> None:
    """Make every log record of this process pass through `redact` (message, arguments and traceback)."""
    global _LOG_REDACTION
    with _LOCK:
        if _LOG_REDACTION:
            return
        _LOG_REDACTION = True
    make_record = logging.getLogRecordFactory()
    formatter = logging.Formatter()

    def redacting_record(*args: object, **kwargs: object) -> logging.LogRecord:
        record = make_record(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # a malformed call is logging's to report, not ours
            return record
        shown = redact(message)
        if shown != message:
            record.msg, record.args = shown, ()
        if record.exc_info and not record.exc_text:
            record.exc_text = redact(formatter.formatException(record.exc_info))
        return record

    logging.setLogRecordFactory(redacting_record)
