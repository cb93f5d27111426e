"""Each cloud's own settings, as obstore's configuration.

obstore reads its own variables when a store is made (``AWS_*``, ``GOOGLE_*``, ``AZURE_*``).
Users of each cloud's SDK and emulators set others, which obstore does not read, or reads
otherwise than they mean. ``store_settings`` turns the environment into the arguments of
obstore's ``from_url`` (``config``, ``client_options``), one row per scheme (``CLOUDS``):

======  ===========================================  =========================================
scheme  what is added to obstore's own reading        which wins where both are set
======  ===========================================  =========================================
s3      the endpoint's variables in boto's order      ``AWS_ENDPOINT_URL_S3``, then
                                                      ``AWS_ENDPOINT_URL``, then ``AWS_ENDPOINT``
gs      ``STORAGE_EMULATOR_HOST`` (google-cloud-      ``GOOGLE_BASE_URL``, then a service
        storage's, fake-gcs-server's): the base       account's ``gcs_base_url``, then
        URL, and requests unsigned, as the SDK        ``STORAGE_EMULATOR_HOST``
        sends them to an emulator
az      ``AZURE_STORAGE_CONNECTION_STRING`` (every    an ``AZURE_STORAGE_*`` variable set on its
        Azure SDK's, Azurite's): account, key or      own, field by field: the account name,
        SAS, endpoint; ``UseDevelopmentStorage=true`` the endpoint, any credential
======  ===========================================  =========================================

On every scheme, an ``http://`` endpoint given explicitly allows plain HTTP (refused where
``*_ALLOW_HTTP`` says false), and the client settings obstore reads from the environment
(``*_ALLOW_HTTP``, ``*_PROXY_URL``, ``*_TIMEOUT``, ...) are carried into ``client_options``:
given any, the library drops those of the environment.

A setting that cannot work is refused here, before any request, in one line naming the
variable to change and never its value (a connection string holds a key).

>>> environ = {"AZURE_STORAGE_CONNECTION_STRING": "UseDevelopmentStorage=true"}
>>> s = store_settings(ObjectUrl.parse("az://models/tiny/"), environ)
>>> s.config["account_name"], s.client_options
('devstoreaccount1', {'allow_http': 'true'})
>>> s.endpoint.url
'http://127.0.0.1:10000/devstoreaccount1'
>>> s.endpoint.source
'UseDevelopmentStorage=true in AZURE_STORAGE_CONNECTION_STRING'
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from ..errors import StorageError
from .urls import ObjectUrl

__all__ = [
    "CLIENT_OPTIONS",
    "CLOUDS",
    "CONNECTION_STRING",
    "DEVSTORE_ACCOUNT",
    "DEVSTORE_ENDPOINT",
    "DEVSTORE_KEY",
    "EMULATOR_HOST",
    "Cloud",
    "Endpoint",
    "StoreSettings",
    "connection_string_settings",
    "default_settings",
    "parse_connection_string",
    "store_settings",
]

#: the client settings obstore reads from the environment, as ``<PREFIX><KEY>`` (upper case):
#: ``AWS_ALLOW_HTTP``, ``GOOGLE_PROXY_URL``, ``AZURE_TIMEOUT``...
CLIENT_OPTIONS = (
    "allow_http",
    "allow_invalid_certificates",
    "connect_timeout",
    "default_content_type",
    "http1_only",
    "http2_keep_alive_interval",
    "http2_keep_alive_timeout",
    "http2_keep_alive_while_idle",
    "http2_max_frame_size",
    "http2_only",
    "pool_idle_timeout",
    "pool_max_idle_per_host",
    "proxy_url",
    "proxy_ca_certificate",
    "proxy_excludes",
    "randomize_addresses",
    "read_timeout",
    "timeout",
    "user_agent",
)
_BOOLEAN_OPTIONS = frozenset(
    {
        "allow_http",
        "allow_invalid_certificates",
        "http1_only",
        "http2_only",
        "http2_keep_alive_while_idle",
        "randomize_addresses",
    }
)
#: the words the library takes for a boolean
_TRUE = frozenset({"1", "true", "on", "yes", "y"})
_FALSE = frozenset({"0", "false", "off", "no", "n"})

#: Azure's connection string, and Azurite's well-known account (public: Microsoft documents it)
CONNECTION_STRING = "AZURE_STORAGE_CONNECTION_STRING"
DEVSTORE_ACCOUNT = "devstoreaccount1"
DEVSTORE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)
DEVSTORE_ENDPOINT = f"http://127.0.0.1:10000/{DEVSTORE_ACCOUNT}"
#: the Google SDKs' emulator setting
EMULATOR_HOST = "STORAGE_EMULATOR_HOST"

_AZ_ACCOUNT_VARIABLES = ("AZURE_STORAGE_ACCOUNT_NAME",)
_AZ_KEY_VARIABLES = (
    "AZURE_STORAGE_ACCOUNT_KEY",
    "AZURE_STORAGE_ACCESS_KEY",
    "AZURE_STORAGE_MASTER_KEY",
)
_AZ_ENDPOINT_VARIABLES = ("AZURE_STORAGE_ENDPOINT", "AZURE_ENDPOINT")
#: obstore's Azure variables that make a credential of their own: any one set, the connection
#: string's key or SAS is not used
_AZ_CREDENTIAL_VARIABLES = (
    *_AZ_KEY_VARIABLES,
    "AZURE_STORAGE_SAS_KEY",
    "AZURE_STORAGE_SAS_TOKEN",
    "AZURE_STORAGE_TOKEN",
    "AZURE_STORAGE_CLIENT_SECRET",
    "AZURE_CLIENT_SECRET",
    "AZURE_FEDERATED_TOKEN_FILE",
    "AZURE_USE_AZURE_CLI",
    "AZURE_SKIP_SIGNATURE",
)
_GCS_ACCOUNT_FILES = ("GOOGLE_SERVICE_ACCOUNT", "GOOGLE_SERVICE_ACCOUNT_PATH")
_GCS_ACCOUNT_KEY = "GOOGLE_SERVICE_ACCOUNT_KEY"


# ------------------------------------------------------------------------------ what comes out


@dataclass(frozen=True)
class Endpoint:
    """An endpoint a setting gave: its URL, the ``variable`` to change, and, where the URL is
    a part of it, which (``detail``: ``"the BlobEndpoint in AZURE_STORAGE_CONNECTION_STRING"``),
    for messages."""

    url: str
    variable: str
    detail: str = ""

    @property
    def source(self) -> str:
        """The setting, as messages name it: ``AWS_ENDPOINT_URL``, ``the BlobEndpoint in
        AZURE_STORAGE_CONNECTION_STRING``."""
        return self.detail or self.variable

    @property
    def shown(self) -> str:
        """The URL as messages may show it: scheme, host, port and path (no user, query or
        fragment: they could carry a secret)."""
        return safe_url(self.url)

    @property
    def plain_http(self) -> bool:
        return self.url.strip().lower().startswith("http://")


@dataclass(frozen=True)
class StoreSettings:
    """What ``from_url`` is given for one scheme, and what messages say about it."""

    scheme: str
    config: dict
    client_options: dict
    #: the endpoint a setting gave (None: the service's own)
    endpoint: Endpoint | None
    #: what to set, or check, for credentials
    credentials: str
    #: the client options carried from the environment: option -> its variable
    carried: dict = field(default_factory=dict)

    @property
    def where(self) -> str:
        """The endpoint for messages: ``http://127.0.0.1:9000 (AWS_ENDPOINT_URL)``, or the
        service's default."""
        if self.endpoint is None:
            return CLOUDS[self.scheme].default_endpoint
        return f"{self.endpoint.shown} ({self.endpoint.source})"

    @property
    def check(self) -> str:
        """What to check when the endpoint does not answer."""
        if self.endpoint is None:
            return "the network"
        return f"{self.endpoint.variable} and the network"


@dataclass(frozen=True)
class _Own:
    """What a cloud's own settings add: obstore ``config`` keys, the endpoint in effect, and
    the credentials hint where it is not the cloud's usual one."""

    config: dict
    endpoint: Endpoint | None = None
    credentials: str | None = None


@dataclass(frozen=True)
class Cloud:
    """One scheme's row: obstore's variables' prefix, the words of its messages, and how the
    cloud's own settings become obstore's (``translate(environ, refuse)``)."""

    scheme: str
    prefix: str
    default_endpoint: str
    credentials: str
    translate: Callable[[Mapping[str, str], Callable[[str], StorageError]], _Own]


# ------------------------------------------------------------------------------ small readers


def _value(environ: Mapping[str, str], name: str) -> str | None:
    """A variable's value, stripped; None where it is unset or empty."""
    text = (environ.get(name) or "").strip()
    return text or None


def _first_set(environ: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    return next((n for n in names if _value(environ, n) is not None), None)


def _set_value(environ: Mapping[str, str], name: str) -> str:
    """The value of a variable ``_first_set`` found set."""
    text = _value(environ, name)
    if text is None:
        raise KeyError(name)
    return text


def _flag(
    environ: Mapping[str, str], name: str, refuse: Callable[[str], StorageError]
) -> bool | None:
    """A boolean variable as the library reads it; None where unset."""
    text = _value(environ, name)
    if text is None:
        return None
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise refuse(f"{name} is not true or false; set it to true or false, or unset it")


def safe_url(value: str) -> str:
    """``value``'s scheme, host, port and path: what a message may show of a URL.

    >>> safe_url("http://user:pw@127.0.0.1:9000/acct?sig=x")
    'http://127.0.0.1:9000/acct'
    """
    try:
        parts = urlsplit(str(value).strip())
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        netloc = host + (f":{parts.port}" if parts.port else "")
        return urlunsplit((parts.scheme, netloc, parts.path, "", "")) or "the endpoint"
    except ValueError:
        return "the endpoint"


def _is_http_url(text: str) -> bool:
    """An http(s) URL with a host and a valid port, no space or control character: what the
    library takes without panicking at the first request (a Rust panic passes every
    ``except Exception``)."""
    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        return False
    return (
        parts.scheme.lower() in ("http", "https")
        and bool(parts.hostname)
        and not any(c.isspace() or ord(c) < 32 for c in text)
    )


def _check_endpoint(endpoint: Endpoint, refuse: Callable[[str], StorageError]) -> None:
    if _is_http_url(endpoint.url.strip()):
        return
    if endpoint.detail:
        raise refuse(
            f"{endpoint.source} is not an http:// or https:// URL with a host; "
            "correct it (http://HOST:PORT)"
        )
    raise refuse(
        f"the endpoint setting {endpoint.variable} is not an http:// or https:// URL "
        "with a host; set it to the endpoint's URL (http://HOST:PORT), or unset it "
        "for the service's own"
    )


# ------------------------------------------------------------------------------------ S3


def _s3(environ: Mapping[str, str], refuse: Callable[[str], StorageError]) -> _Own:
    """boto's endpoint variables in boto's order. The library itself prefers
    ``AWS_ENDPOINT_URL_S3``, but reads ``AWS_ENDPOINT_URL`` and ``AWS_ENDPOINT`` into one key
    in no set order: where the first is unset, the endpoint is given to it explicitly."""
    name = _first_set(environ, ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT"))
    if name is None:
        return _Own({})
    endpoint = Endpoint(_set_value(environ, name), name)
    config = {} if name == "AWS_ENDPOINT_URL_S3" else {"endpoint": endpoint.url}
    return _Own(config, endpoint)


# ------------------------------------------------------------------------------------ GCS


def _service_account_base_url(environ: Mapping[str, str], name: str) -> str | None:
    """The ``gcs_base_url`` of the service account ``name`` gives (a file's path; for
    ``GOOGLE_SERVICE_ACCOUNT_KEY`` the key's JSON itself), or None. A file that cannot be
    read is the library's to report."""
    text = _value(environ, name)
    if text is None:
        return None
    try:
        if name != _GCS_ACCOUNT_KEY:
            with open(text, encoding="utf-8") as f:
                text = f.read(1 << 20)
        url = json.loads(text).get("gcs_base_url")
    except (OSError, ValueError, AttributeError):
        return None
    return url.strip() if isinstance(url, str) and url.strip() else None


def _gcs(environ: Mapping[str, str], refuse: Callable[[str], StorageError]) -> _Own:
    """``STORAGE_EMULATOR_HOST`` as the Google SDKs take it: the base URL, and no credentials
    (the SDK talks to an emulator anonymously), unless obstore's own settings say
    otherwise."""
    base_url = _value(environ, "GOOGLE_BASE_URL")
    if base_url is not None:
        return _Own({}, Endpoint(base_url, "GOOGLE_BASE_URL"))
    for name in (*_GCS_ACCOUNT_FILES, _GCS_ACCOUNT_KEY):
        url = _service_account_base_url(environ, name)
        if url is not None:
            where = name if name == _GCS_ACCOUNT_KEY else f"the file {name} names"
            return _Own({}, Endpoint(url, name, f"the gcs_base_url in {where}"))
    emulator = _value(environ, EMULATOR_HOST)
    if emulator is None:
        return _Own({})
    config: dict[str, Any] = {"base_url": emulator.rstrip("/")}
    if _value(environ, "GOOGLE_SKIP_SIGNATURE") is None:
        config["skip_signature"] = True
    return _Own(
        config,
        Endpoint(emulator, EMULATOR_HOST),
        f"{EMULATOR_HOST} (requests to an emulator are not signed)",
    )


# ------------------------------------------------------------------------------------ Azure


def parse_connection_string(text: str) -> dict[str, str]:
    """An Azure connection string's ``KEY=VALUE`` pairs (separated by ``;``), the keys upper
    case, as the Azure SDKs read them. ``ValueError`` where it is not one, saying where,
    never repeating a part of it (it holds a key).

    >>> parse_connection_string("UseDevelopmentStorage=true")
    {'USEDEVELOPMENTSTORAGE': 'true'}
    >>> parse_connection_string("AccountName=a;c2VjcmV0")
    Traceback (most recent call last):
    ...
    ValueError: is not KEY=VALUE pairs separated by ';' (part 2 of 2 has no KEY=)
    """
    text = text.strip().rstrip(";")
    if not text:
        raise ValueError("is empty")
    parts = text.split(";")
    fields: dict[str, str] = {}
    for i, part in enumerate(parts, 1):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise ValueError(
                f"is not KEY=VALUE pairs separated by ';' (part {i} of {len(parts)} has no KEY=)"
            )
        fields[key.strip().upper()] = value.strip()
    return fields


@dataclass(frozen=True)
class ConnectionSettings:
    """What a connection string says for Blob Storage: the account (None: it names none), its
    key or SAS (None: neither), the blob endpoint, and which of its fields gave that
    (``"the BlobEndpoint"``)."""

    account: str | None
    key: str | None
    sas: str | None
    endpoint: str
    endpoint_field: str


def _account_in(endpoint: str) -> str | None:
    """The account a blob endpoint shows: ``ACCOUNT.blob.SUFFIX``, else (an emulator's,
    ``http://127.0.0.1:10000/ACCOUNT``) its path's first part."""
    try:
        parts = urlsplit(endpoint)
    except ValueError:
        return None
    host = parts.hostname or ""
    if ".blob." in host:
        return host.split(".", 1)[0] or None
    return parts.path.strip("/").split("/", 1)[0] or None


def connection_string_settings(fields: Mapping[str, str]) -> ConnectionSettings:
    """A parsed connection string's Blob Storage settings, as the Azure SDKs read them:
    ``UseDevelopmentStorage=true`` is Azurite on 127.0.0.1:10000 with its well-known account;
    else ``BlobEndpoint``, or ``https://ACCOUNT.blob.core.windows.net`` (the protocol and
    ``EndpointSuffix`` where both are given). ``ValueError`` (no value in it) where it names
    no endpoint.

    >>> s = connection_string_settings({"USEDEVELOPMENTSTORAGE": "true"})
    >>> s.account, s.endpoint
    ('devstoreaccount1', 'http://127.0.0.1:10000/devstoreaccount1')
    >>> connection_string_settings({"ACCOUNTNAME": "acct", "ACCOUNTKEY": "k"}).endpoint
    'https://acct.blob.core.windows.net'
    """
    if (fields.get("USEDEVELOPMENTSTORAGE") or "").lower() == "true":
        return ConnectionSettings(
            DEVSTORE_ACCOUNT, DEVSTORE_KEY, None, DEVSTORE_ENDPOINT, "UseDevelopmentStorage=true"
        )
    account = fields.get("ACCOUNTNAME") or None
    endpoint, where = fields.get("BLOBENDPOINT") or None, "the BlobEndpoint"
    if endpoint is None:
        if fields.get("BLOBSECONDARYENDPOINT"):
            raise ValueError(
                "names only a secondary endpoint (BlobSecondaryEndpoint); add BlobEndpoint=..."
            )
        if account is None:
            raise ValueError(
                "names neither an account (AccountName=...) nor an endpoint (BlobEndpoint=...)"
            )
        protocol, suffix = fields.get("DEFAULTENDPOINTSPROTOCOL"), fields.get("ENDPOINTSUFFIX")
        if protocol and suffix:
            if protocol.lower() not in ("http", "https"):
                raise ValueError("has a DefaultEndpointsProtocol that is neither http nor https")
            endpoint = f"{protocol.lower()}://{account}.blob.{suffix}"
            where = "the AccountName and EndpointSuffix"
        else:
            endpoint = f"https://{account}.blob.{suffix or 'core.windows.net'}"
            where = "the AccountName"
    return ConnectionSettings(
        account or _account_in(endpoint),
        fields.get("ACCOUNTKEY") or None,
        (fields.get("SHAREDACCESSSIGNATURE") or "").lstrip("?") or None,
        endpoint,
        where,
    )


def _is_base64(text: str) -> bool:
    try:
        base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return False
    return True


def _azure(environ: Mapping[str, str], refuse: Callable[[str], StorageError]) -> _Own:
    """``AZURE_STORAGE_CONNECTION_STRING``, each of its fields used where obstore's own
    variable for it is unset; and what obstore would find missing only at the first request
    (an account, a key that is not base64), refused now."""
    config: dict[str, Any] = {}
    endpoint: Endpoint | None = None
    credentials = None
    name = _first_set(environ, _AZ_ENDPOINT_VARIABLES)
    emulator = _flag(environ, "AZURE_STORAGE_USE_EMULATOR", refuse)
    if name is not None:
        endpoint = Endpoint(_set_value(environ, name), name)
    elif emulator:
        endpoint = Endpoint(
            _value(environ, "AZURITE_BLOB_STORAGE_URL") or "http://127.0.0.1:10000",
            "AZURE_STORAGE_USE_EMULATOR",
        )
    text = _value(environ, CONNECTION_STRING)
    if text is not None:
        try:
            conn = connection_string_settings(parse_connection_string(text))
        except ValueError as exc:
            raise refuse(
                f"{CONNECTION_STRING} {exc}; set it as the Azure portal or Azurite's "
                "documentation gives it (AccountName=...;AccountKey=...;"
                "BlobEndpoint=...), or to UseDevelopmentStorage=true"
            ) from None
        if endpoint is None:
            endpoint = Endpoint(
                conn.endpoint, CONNECTION_STRING, f"{conn.endpoint_field} in {CONNECTION_STRING}"
            )
            config["endpoint"] = conn.endpoint
        if _first_set(environ, _AZ_ACCOUNT_VARIABLES) is None:
            if conn.account is None:
                raise refuse(f"{CONNECTION_STRING} names no account; add AccountName=...")
            config["account_name"] = conn.account
        if _first_set(environ, _AZ_CREDENTIAL_VARIABLES) is None:
            if conn.key is not None:
                if not _is_base64(conn.key):
                    raise refuse(
                        f"the AccountKey in {CONNECTION_STRING} is not base64; copy "
                        "the account's key again"
                    )
                config["account_key"] = conn.key
            elif conn.sas is not None:
                config["sas_key"] = conn.sas
            else:
                raise refuse(
                    f"{CONNECTION_STRING} holds no key: add the account's key "
                    "(AccountKey=...) or a shared access signature "
                    "(SharedAccessSignature=...)"
                )
            credentials = f"{CONNECTION_STRING} (its AccountKey or SharedAccessSignature)"
    elif _first_set(environ, _AZ_ACCOUNT_VARIABLES) is None and not emulator:
        raise refuse(
            f"no Azure storage account is set; set {CONNECTION_STRING} (Azurite: "
            "UseDevelopmentStorage=true), or AZURE_STORAGE_ACCOUNT_NAME with "
            "AZURE_STORAGE_ACCOUNT_KEY"
        )
    key_name = _first_set(environ, _AZ_KEY_VARIABLES)
    if key_name is not None and not _is_base64(_set_value(environ, key_name)):
        raise refuse(f"{key_name} is not base64; copy the account's key again")
    return _Own(config, endpoint, credentials)


# ------------------------------------------------------------------------------------ the table

#: one row per scheme
CLOUDS: dict[str, Cloud] = {
    c.scheme: c
    for c in (
        Cloud(
            "s3",
            "AWS_",
            "the default AWS endpoint",
            "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN) or AWS_PROFILE",
            _s3,
        ),
        Cloud(
            "gs",
            "GOOGLE_",
            "the default Google Cloud endpoint",
            f"GOOGLE_APPLICATION_CREDENTIALS or GOOGLE_SERVICE_ACCOUNT ({EMULATOR_HOST} for an "
            "emulator)",
            _gcs,
        ),
        Cloud(
            "az",
            "AZURE_",
            "the default Azure endpoint",
            f"{CONNECTION_STRING}, or AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY "
            "(or a SAS or Entra ID token)",
            _azure,
        ),
    )
}


def store_settings(
    loc: ObjectUrl,
    environ: Mapping[str, str] | None = None,
    client_defaults: Mapping[str, Any] | None = None,
) -> StoreSettings:
    """The arguments of ``from_url`` for ``loc``'s bucket, from ``environ`` (default: this
    process's): the cloud's own settings translated (``CLOUDS``), plain HTTP allowed for an
    explicit ``http://`` endpoint, and the environment's client settings carried over onto
    ``client_defaults`` (ours: the timeouts). A setting that cannot work is a
    ``StorageError`` (``usage=True``) naming its variable."""
    environ = os.environ if environ is None else environ
    cloud = CLOUDS[loc.scheme]

    def refuse(message: str) -> StorageError:
        return StorageError(message, url=str(loc), usage=True)

    own = cloud.translate(environ, refuse)
    if own.endpoint is not None:
        _check_endpoint(own.endpoint, refuse)
    options: dict[str, Any] = dict(client_defaults or {})
    carried: dict[str, str] = {}
    for option in CLIENT_OPTIONS:
        name = cloud.prefix + option.upper()
        text = _value(environ, name)
        if text is None:
            continue
        if option in _BOOLEAN_OPTIONS:
            _flag(environ, name, refuse)
        options[option], carried[option] = text, name
    allow_name = cloud.prefix + "ALLOW_HTTP"
    if own.endpoint is not None and own.endpoint.plain_http:
        if _flag(environ, allow_name, refuse) is False:
            raise refuse(
                f"{own.endpoint.source} gives an http:// endpoint, and {allow_name} "
                f"forbids plain HTTP; unset {allow_name}, or give an https:// "
                "endpoint"
            )
        options["allow_http"] = "true"
    return StoreSettings(
        loc.scheme, own.config, options, own.endpoint, own.credentials or cloud.credentials, carried
    )


def default_settings(scheme: str) -> StoreSettings:
    """A scheme's settings when nothing is known of its environment: for messages."""
    return StoreSettings(scheme, {}, {}, None, CLOUDS[scheme].credentials)
