"""Each cloud's own settings (``shardload.sources.settings``), as its SDK and its emulator's
documentation give them, against the real emulators on 127.0.0.1 (moto, fake-gcs-server,
Azurite, behind the counting proxy of ``helpers/objectservers.py``):

* each loads the example checkpoint, its pieces equal to a local load's:
  ``AWS_ENDPOINT_URL=http://...`` with no ``AWS_ALLOW_HTTP``, ``STORAGE_EMULATOR_HOST``,
  ``AZURE_STORAGE_CONNECTION_STRING`` in its full, shared-access-signature and
  ``UseDevelopmentStorage=true`` forms; and where a cloud's own setting and the library's both
  say a thing, the documented one wins;
* each wrong or missing setting is refused in one line naming the variable to correct (never
  its value), at once: before any request where it can be told from the setting (the proxy's
  log is empty), in one request where the service must say (a wrong key), and without the
  library's retries where nothing listens (a retry would first wait a second);
* the parsing, as pure functions.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone

import pytest
import torch

pytest.importorskip("obstore")

from helpers import objectservers
from helpers.objectservers import AZURITE_ACCOUNT, AZURITE_KEY
from helpers.paths import EXAMPLE, REPO
from helpers.subprocesses import subprocess_env

from shardload import StorageError, ThreadedSession, load_sharded
from shardload.sources import settings as settingsmod
from shardload.sources import store as store_module
from shardload.sources import store_config
from shardload.sources.store import ObjectClient
from shardload.sources.urls import ObjectUrl

BUCKET = "models"
NAME = os.path.basename(EXAMPLE)  # tiny_llama_q4, as the docs upload it
#: what moto takes, as its documentation writes it
S3_KEYS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_REGION": "us-east-1",
}
#: a retry would wait this long first: a refusal quicker than it was not retried
SLOW_BACKOFF = 1.0
#: a refusal that needs no request comes within this many seconds
AT_ONCE_S = 0.9


# -- servers ----------------------------------------------------------------------------------


def _upload(server: objectservers.ObjectServer) -> None:
    server.make_bucket(BUCKET)
    for name in sorted(os.listdir(EXAMPLE)):
        with open(os.path.join(EXAMPLE, name), "rb") as f:
            server.put(BUCKET, f"{NAME}/{name}", f.read())


@pytest.fixture(scope="module")
def servers():
    """The module's servers, one per scheme, each started (the example uploaded) when a test
    first asks for it, stopped when the module ends."""
    yield from objectservers.servers_on_demand(_upload)


def _clean(monkeypatch, env: dict) -> None:
    """``env`` this process's only cloud settings, no proxy between it and the servers, and a
    fresh default client (it reads the settings when it makes a store)."""
    objectservers.use_env(monkeypatch, env)
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    store_module.reset_default_client()


@pytest.fixture
def at(servers):
    """``at(scheme)``: the scheme's server, its faults cleared and its counts reset."""

    def server(scheme: str) -> objectservers.ObjectServer:
        srv = servers(scheme)
        srv.clear_faults()
        srv.reset_counts()
        return srv

    return server


@pytest.fixture
def setenv(monkeypatch):
    """``setenv(env)``: ``env`` this process's only cloud settings (``_clean``)."""
    yield lambda env: _clean(monkeypatch, env)
    store_module.reset_default_client()


def url(scheme: str) -> str:
    return f"{scheme}://{BUCKET}/{NAME}/"


def loads_as_local(scheme: str, n: int = 2) -> None:
    """The example loads from ``scheme`` with every worker's pieces equal to the local load's,
    bitwise."""
    with ThreadedSession(n) as sess:
        local = load_sharded(EXAMPLE, None, sess, progress=False)
        remote = load_sharded(url(scheme), None, sess, progress=False)
        for i in range(n):
            a, b = local.worker(i), remote.worker(i)
            assert a.keys() == b.keys()
            for name in a:
                assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape
                assert torch.equal(
                    a[name].view(-1).view(torch.uint8), b[name].view(-1).view(torch.uint8)
                ), (i, name)


def dead_port() -> socket.socket:
    """A socket bound to a port of 127.0.0.1 and never listening: a connection is refused."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


def refused(call, *names: str, secrets: tuple = (), bound: float = AT_ONCE_S) -> StorageError:
    """``call()`` raises a one-line ``StorageError`` within ``bound`` seconds, naming every one
    of ``names``, repeating none of ``secrets``, chaining nothing."""
    began = time.monotonic()
    with pytest.raises(StorageError) as info:
        call()
    took = time.monotonic() - began
    exc = info.value
    text = str(exc)
    assert took < bound, f"took {took:.2f} s: {text}"
    assert "\n" not in text, text
    for name in names:
        assert name in text, text
    for secret in secrets:
        assert secret not in text and secret not in repr(exc), text
    assert exc.__cause__ is None and (exc.__context__ is None or exc.__suppress_context__)
    return exc


def head(scheme: str):
    """A head of the example's safetensors file by a client whose retries would be slow."""
    client = ObjectClient(retries=2, backoff=SLOW_BACKOFF)
    return lambda: client.head(url(scheme) + "model.safetensors")


def connection_string(endpoint: str, key: str = AZURITE_KEY) -> str:
    """The full form, as Azurite's documentation writes it."""
    return (
        f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={key};"
        f"BlobEndpoint={endpoint}/{AZURITE_ACCOUNT};"
    )


def sas(permission: str = "rl") -> str:
    """A read and list shared access signature for the container, signed with Azurite's key."""
    from azure.storage.blob import ContainerSasPermissions, generate_container_sas

    return generate_container_sas(
        AZURITE_ACCOUNT,
        BUCKET,
        account_key=AZURITE_KEY,
        permission=ContainerSasPermissions.from_string(permission),
        expiry=datetime.now(timezone.utc) + timedelta(hours=1),
    )


# -- each cloud's own settings load -----------------------------------------------------------

CONNECTION_STRING = "AZURE_STORAGE_CONNECTION_STRING"
azurite = pytest.mark.azurite


def _no_authorization(server: objectservers.ObjectServer) -> bool:
    return not any(k.lower() == "authorization" for r in server.requests() for k in r.headers)


def test_aws_endpoint_url_without_allow_http_loads(at, setenv):
    # what boto3 needs, and nothing more: an http:// endpoint given explicitly is plain HTTP
    server = at("s3")
    setenv({"AWS_ENDPOINT_URL": server.endpoint, **S3_KEYS})
    loads_as_local("s3")
    assert server.bytes_sent(f"{NAME}/model.safetensors") > 0


def test_storage_emulator_host_loads_unsigned(at, setenv):
    # google-cloud-storage's and fake-gcs-server's setting; the SDK talks to an emulator
    # anonymously, and so does the client: no credentials looked for, no request signed
    server = at("gs")
    setenv({"STORAGE_EMULATOR_HOST": server.endpoint})
    loads_as_local("gs")
    assert server.requests() and _no_authorization(server)


@azurite
def test_a_connection_string_loads(at, setenv):
    server = at("az")
    setenv({CONNECTION_STRING: connection_string(server.endpoint)})
    loads_as_local("az")
    assert server.bytes_sent(f"{NAME}/model.safetensors") > 0


@azurite
def test_a_connection_string_with_a_shared_access_signature_loads(at, setenv):
    server = at("az")
    setenv(
        {
            CONNECTION_STRING: f"BlobEndpoint={server.endpoint}/{AZURITE_ACCOUNT};"
            f"SharedAccessSignature={sas()}"
        }
    )
    loads_as_local("az")
    # signed by the SAS (in the query), not by a key (the Authorization header)
    assert all("sig=" in r.query for r in server.requests()) and _no_authorization(server)


@pytest.fixture
def azurite_at_10000():
    """Azurite behind the proxy on 127.0.0.1:10000, where ``UseDevelopmentStorage=true``
    points (skips where that port is taken)."""
    server = objectservers.make_server("az", proxy_port=10000)
    try:
        server.start()
    except OSError as exc:
        pytest.skip(f"port 10000 on 127.0.0.1, Azurite's own, is taken here ({exc})")
    try:
        _upload(server)
        yield server
    finally:
        server.close()


@azurite
def test_use_development_storage_loads(azurite_at_10000, setenv):
    setenv({CONNECTION_STRING: "UseDevelopmentStorage=true"})
    loads_as_local("az")
    assert azurite_at_10000.bytes_sent(f"{NAME}/model.safetensors") > 0


# -- where a cloud's own setting and the library's both say a thing --------------------------


def test_aws_endpoint_url_s3_wins_over_aws_endpoint_url(at, setenv):
    server = at("s3")
    with dead_port() as dead:
        setenv(
            {
                "AWS_ENDPOINT_URL_S3": server.endpoint,
                "AWS_ENDPOINT_URL": f"http://127.0.0.1:{dead.getsockname()[1]}",
                **S3_KEYS,
            }
        )
        loads_as_local("s3")


def test_a_service_accounts_endpoint_wins_over_storage_emulator_host(at, setenv):
    server = at("gs")
    with dead_port() as dead:
        setenv(
            {**server.env(), "STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{dead.getsockname()[1]}"}
        )
        loads_as_local("gs")


@azurite
def test_azure_storage_variables_win_over_the_connection_strings_fields(at, setenv):
    # the string's endpoint is dead and its key wrong: the variables' are used, field by field
    server = at("az")
    wrong = "d3Jvbmcga2V5IG9mIHRoZSBhY2NvdW50IGZvciB0aGlzIHRlc3Q="
    with dead_port() as dead:
        setenv(
            {
                CONNECTION_STRING: connection_string(
                    f"http://127.0.0.1:{dead.getsockname()[1]}", key=wrong
                ),
                "AZURE_STORAGE_ENDPOINT": f"{server.endpoint}/{AZURITE_ACCOUNT}",
                "AZURE_STORAGE_ACCOUNT_KEY": AZURITE_KEY,
            }
        )
        loads_as_local("az")


def test_the_environments_client_settings_still_apply(at, setenv):
    # given client options, the library drops those it reads from the environment: they are
    # carried over. AWS_TIMEOUT=300ms against an answer delayed 2 s: timed out, and said so
    server = at("s3")
    setenv({"AWS_ENDPOINT_URL": server.endpoint, "AWS_TIMEOUT": "300ms", **S3_KEYS})
    server.inject("delay", seconds=2, method="HEAD", times=None)
    client = ObjectClient(retries=0)
    exc = refused(lambda: client.head(url("s3") + "model.safetensors"), "AWS_TIMEOUT", bound=1.8)
    assert "timed out" in str(exc) and not exc.usage


# -- a wrong or missing setting: one line, its variable, at once ------------------------------


def _dead_env(variable: str, endpoint: str) -> dict:
    return {
        "AWS_ENDPOINT_URL": {"AWS_ENDPOINT_URL": endpoint, **S3_KEYS},
        "STORAGE_EMULATOR_HOST": {"STORAGE_EMULATOR_HOST": endpoint},
        CONNECTION_STRING: {CONNECTION_STRING: connection_string(endpoint)},
        "AZURE_STORAGE_ENDPOINT": {
            "AZURE_STORAGE_ACCOUNT_NAME": AZURITE_ACCOUNT,
            "AZURE_STORAGE_ACCOUNT_KEY": AZURITE_KEY,
            "AZURE_STORAGE_ENDPOINT": f"{endpoint}/{AZURITE_ACCOUNT}",
        },
    }[variable]


@pytest.mark.parametrize(
    "scheme, variable",
    [
        ("s3", "AWS_ENDPOINT_URL"),
        ("gs", "STORAGE_EMULATOR_HOST"),
        ("az", CONNECTION_STRING),
        ("az", "AZURE_STORAGE_ENDPOINT"),
    ],
)
def test_a_dead_port_is_refused_at_once_naming_its_variable(setenv, scheme, variable):
    # the library would retry a refused connection for seconds; no retry cures a setting
    with dead_port() as dead:
        endpoint = f"http://127.0.0.1:{dead.getsockname()[1]}"
        setenv(_dead_env(variable, endpoint))
        exc = refused(head(scheme), variable, endpoint, "refused", secrets=(AZURITE_KEY,))
    assert exc.usage is False  # the network's, as a dead endpoint always was: exit 1


def test_use_development_storage_with_no_azurite_names_the_connection_string(setenv):
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", 10000)) == 0:
            pytest.skip("something listens on 127.0.0.1:10000 here")
    setenv({CONNECTION_STRING: "UseDevelopmentStorage=true"})
    refused(
        head("az"),
        CONNECTION_STRING,
        "UseDevelopmentStorage",
        "127.0.0.1:10000",
        secrets=(AZURITE_KEY,),
    )


def test_a_connection_refused_mid_load_names_its_variable(setenv):
    # the store is made while something listens there; it is gone when the request is made:
    # the library's retries, then one line naming the variable, not "the endpoint setting"
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    endpoint = f"http://127.0.0.1:{listener.getsockname()[1]}"
    setenv({"AWS_ENDPOINT_URL": endpoint, **S3_KEYS})
    client = ObjectClient(retries=1, backoff=0.01)
    client._store(ObjectUrl.parse(url("s3")))
    listener.close()
    exc = refused(
        lambda: client.head(url("s3") + "model.safetensors"),
        "check AWS_ENDPOINT_URL",
        endpoint,
        "2 attempts",
        bound=10,
    )
    assert exc.usage is False


def test_an_http_endpoint_that_allow_http_forbids_is_refused(at, setenv):
    server = at("s3")
    setenv({"AWS_ENDPOINT_URL": server.endpoint, "AWS_ALLOW_HTTP": "false", **S3_KEYS})
    exc = refused(head("s3"), "AWS_ENDPOINT_URL", "AWS_ALLOW_HTTP")
    assert exc.usage and server.requests() == []


@pytest.mark.parametrize("variable, value", [("AWS_TIMEOUT", "soon"), ("AWS_ALLOW_HTTP", "maybe")])
def test_a_client_setting_the_client_cannot_take_is_refused(at, setenv, variable, value):
    server = at("s3")
    setenv({"AWS_ENDPOINT_URL": server.endpoint, variable: value, **S3_KEYS})
    exc = refused(head("s3"), variable, secrets=(value,))
    assert exc.usage and server.requests() == []


def test_storage_emulator_host_without_a_scheme_is_refused(at, setenv):
    # google-cloud-storage takes it as a URL; without http:// it is not one
    server = at("gs")
    setenv({"STORAGE_EMULATOR_HOST": server.endpoint.removeprefix("http://")})
    exc = refused(head("gs"), "STORAGE_EMULATOR_HOST", "http://HOST:PORT")
    assert exc.usage and server.requests() == []


#: connection strings that cannot work: what each must say, and what it must not repeat
SECRET_PART = AZURITE_KEY[:24]
BAD_STRINGS = {
    "malformed": (
        lambda ep: f"AccountName={AZURITE_ACCOUNT};{SECRET_PART}",
        "is not KEY=VALUE pairs",
    ),
    "empty": (lambda ep: " ; ", "is empty"),
    "missing its key": (
        lambda ep: f"AccountName={AZURITE_ACCOUNT};BlobEndpoint={ep}/{AZURITE_ACCOUNT}",
        "holds no key",
    ),
    "a key not base64": (
        lambda ep: connection_string(ep, key=f"{SECRET_PART}!not-base64"),
        "the AccountKey in",
    ),
    "an endpoint not a URL": (
        lambda ep: connection_string(ep.removeprefix("http://")),
        "the BlobEndpoint in",
    ),
    "no account": (lambda ep: f"AccountKey={AZURITE_KEY};BlobEndpoint={ep}", "names no account"),
}


@azurite
@pytest.mark.parametrize("what", sorted(BAD_STRINGS))
def test_a_connection_string_that_cannot_work_is_refused_before_any_request(at, setenv, what):
    server = at("az")
    make, says = BAD_STRINGS[what]
    setenv({CONNECTION_STRING: make(server.endpoint)})
    exc = refused(
        head("az"), CONNECTION_STRING, says, secrets=(AZURITE_KEY, SECRET_PART, server.endpoint[7:])
    )
    assert exc.usage and server.requests() == []


@azurite
@pytest.mark.parametrize("credential", ["key", "sas"])
def test_a_wrong_credential_in_the_connection_string_is_one_request(at, setenv, credential):
    # the service must say it: one request (a 403 is not retried), the string named, its
    # key or signature not repeated
    server = at("az")
    if credential == "key":
        secret = "d3Jvbmcga2V5IG9mIHRoZSBhY2NvdW50IGZvciB0aGlzIHRlc3Q="
        text = connection_string(server.endpoint, key=secret)
    else:
        good = sas()
        secret = good.split("sig=")[1]
        text = (
            f"BlobEndpoint={server.endpoint}/{AZURITE_ACCOUNT};"
            f"SharedAccessSignature={good.replace('sig=', 'sig=AAAA')}"
        )
    setenv({CONNECTION_STRING: text})
    exc = refused(head("az"), CONNECTION_STRING, secrets=(secret, secret[:12]))
    assert exc.usage and len(server.requests()) == 1


def test_no_azure_account_at_all_names_the_connection_string(setenv):
    setenv({})
    exc = refused(head("az"), CONNECTION_STRING, "AZURE_STORAGE_ACCOUNT_NAME")
    assert exc.usage


def test_the_cli_refuses_a_malformed_connection_string_in_one_line_exit_2():
    env = {k: v for k, v in os.environ.items() if not objectservers.is_cloud_setting(k)}
    env[CONNECTION_STRING] = f"AccountName={AZURITE_ACCOUNT};{SECRET_PART}"
    run = subprocess.run(
        [sys.executable, "-m", "shardload", "load", "--shards", "2", url("az")],
        capture_output=True,
        text=True,
        timeout=120,
        env=subprocess_env(env),
        cwd=REPO,
    )
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and CONNECTION_STRING in lines[0], run.stderr
    assert SECRET_PART not in run.stderr + run.stdout


# -- the parsing, alone -------------------------------------------------------------------------


def test_doctests():
    import doctest

    assert doctest.testmod(settingsmod).failed == 0


def test_parse_connection_string():
    parse = settingsmod.parse_connection_string
    assert parse(" accountname=a; AccountKey=a2V5==;BlobEndpoint=http://h:1/a; ") == {
        "ACCOUNTNAME": "a",
        "ACCOUNTKEY": "a2V5==",
        "BLOBENDPOINT": "http://h:1/a",
    }
    assert parse("UseDevelopmentStorage=true;") == {"USEDEVELOPMENTSTORAGE": "true"}
    for text, says in [
        ("", "is empty"),
        (";", "is empty"),
        ("a=1;;b=2", "part 2 of 3"),
        ("a=1;s3cr3tK3y", "part 2 of 2"),
        ("=x", "part 1 of 1"),
    ]:
        with pytest.raises(ValueError) as info:
            parse(text)
        assert says in str(info.value) and "s3cr3t" not in str(info.value)


def test_connection_string_settings():
    of = settingsmod.connection_string_settings
    dev = of({"USEDEVELOPMENTSTORAGE": "True"})
    assert (dev.account, dev.key, dev.endpoint) == (
        AZURITE_ACCOUNT,
        AZURITE_KEY,
        "http://127.0.0.1:10000/devstoreaccount1",
    )
    # the account where the endpoint shows it: an emulator's path, a service's host
    assert of({"BLOBENDPOINT": "http://127.0.0.1:1/acct", "ACCOUNTKEY": "k"}).account == "acct"
    assert (
        of(
            {
                "BLOBENDPOINT": "https://acct2.blob.core.windows.net",
                "SHAREDACCESSSIGNATURE": "?sv=1&sig=x",
            }
        ).sas
        == "sv=1&sig=x"
    )
    assert of({"BLOBENDPOINT": "https://acct2.blob.core.windows.net"}).account == "acct2"
    assert of({"BLOBENDPOINT": "http://127.0.0.1:1"}).account is None
    # no BlobEndpoint: the Azure SDKs' rule (the protocol only with an EndpointSuffix)
    assert (
        of(
            {
                "ACCOUNTNAME": "a",
                "DEFAULTENDPOINTSPROTOCOL": "http",
                "ENDPOINTSUFFIX": "example.net",
            }
        ).endpoint
        == "http://a.blob.example.net"
    )
    assert (
        of({"ACCOUNTNAME": "a", "DEFAULTENDPOINTSPROTOCOL": "http"}).endpoint
        == "https://a.blob.core.windows.net"
    )
    assert (
        of({"ACCOUNTNAME": "a", "ENDPOINTSUFFIX": "core.chinacloudapi.cn"}).endpoint
        == "https://a.blob.core.chinacloudapi.cn"
    )
    for fields, says in [
        ({"ACCOUNTKEY": "k"}, "neither an account"),
        ({"ACCOUNTNAME": "a", "BLOBSECONDARYENDPOINT": "http://h"}, "only a secondary"),
        (
            {"ACCOUNTNAME": "a", "DEFAULTENDPOINTSPROTOCOL": "ftp", "ENDPOINTSUFFIX": "x"},
            "neither http nor https",
        ),
    ]:
        with pytest.raises(ValueError, match=says):
            of(fields)


def _settings(scheme: str, env: dict) -> settingsmod.StoreSettings:
    return settingsmod.store_settings(
        ObjectUrl.parse(f"{scheme}://models/x"), env, client_defaults={"timeout": "30s"}
    )


def test_s3_settings():
    s = _settings("s3", {"AWS_ENDPOINT_URL": "http://h:9000", "AWS_PROXY_URL": "http://p:3"})
    assert s.config == {"endpoint": "http://h:9000"}
    assert s.client_options == {"timeout": "30s", "proxy_url": "http://p:3", "allow_http": "true"}
    assert s.carried == {"proxy_url": "AWS_PROXY_URL"}
    assert s.where == "http://h:9000 (AWS_ENDPOINT_URL)" and "AWS_ENDPOINT_URL" in s.check
    # the library itself prefers AWS_ENDPOINT_URL_S3: nothing to give it
    s = _settings("s3", {"AWS_ENDPOINT_URL_S3": "https://h", "AWS_ENDPOINT_URL": "http://o"})
    assert s.config == {} and s.endpoint.variable == "AWS_ENDPOINT_URL_S3"
    assert "allow_http" not in s.client_options
    assert _settings("s3", {"AWS_ENDPOINT": "http://h", "AWS_TIMEOUT": "1s"}).client_options == {
        "timeout": "1s",
        "allow_http": "true",
    }  # the environment's over ours
    s = _settings("s3", {})
    assert s.endpoint is None and s.where == "the default AWS endpoint"


def test_gcs_settings(tmp_path):
    s = _settings("gs", {"STORAGE_EMULATOR_HOST": "http://127.0.0.1:4443/"})
    assert s.config == {"base_url": "http://127.0.0.1:4443", "skip_signature": True}
    assert s.client_options["allow_http"] == "true" and "STORAGE_EMULATOR_HOST" in s.credentials
    s = _settings("gs", {"STORAGE_EMULATOR_HOST": "http://h:1", "GOOGLE_SKIP_SIGNATURE": "false"})
    assert s.config == {"base_url": "http://h:1"}  # the library's own setting says
    account = tmp_path / "sa.json"
    account.write_text('{"gcs_base_url": "http://h:2", "disable_oauth": true}')
    s = _settings(
        "gs", {"GOOGLE_SERVICE_ACCOUNT": str(account), "STORAGE_EMULATOR_HOST": "http://e:1"}
    )
    assert s.config == {} and s.endpoint.url == "http://h:2"
    assert s.endpoint.source == "the gcs_base_url in the file GOOGLE_SERVICE_ACCOUNT names"
    s = _settings("gs", {"GOOGLE_BASE_URL": "https://g", "STORAGE_EMULATOR_HOST": "http://e:1"})
    assert s.config == {} and s.endpoint.variable == "GOOGLE_BASE_URL"


def test_azure_settings_field_by_field():
    text = f"AccountName=a;AccountKey={AZURITE_KEY};BlobEndpoint=http://h:1/a"
    s = _settings("az", {CONNECTION_STRING: text})
    assert s.config == {"endpoint": "http://h:1/a", "account_name": "a", "account_key": AZURITE_KEY}
    assert s.client_options["allow_http"] == "true" and CONNECTION_STRING in s.credentials
    s = _settings(
        "az",
        {
            CONNECTION_STRING: text,
            "AZURE_STORAGE_ACCOUNT_NAME": "b",
            "AZURE_STORAGE_SAS_KEY": "sv=1&sig=x",
            "AZURE_STORAGE_ENDPOINT": "https://b.blob.core.windows.net",
        },
    )
    assert s.config == {} and s.endpoint.variable == "AZURE_STORAGE_ENDPOINT"
    s = _settings(
        "az",
        {
            CONNECTION_STRING: "BlobEndpoint=https://c.blob.core.windows.net;"
            "SharedAccessSignature=sv=1&sig=x"
        },
    )
    assert s.config == {
        "endpoint": "https://c.blob.core.windows.net",
        "account_name": "c",
        "sas_key": "sv=1&sig=x",
    }
    assert "allow_http" not in s.client_options


@pytest.mark.parametrize(
    "scheme, env, names",
    [
        ("s3", {"AWS_ENDPOINT_URL": "s3cr3t-host:9000"}, "AWS_ENDPOINT_URL"),
        ("s3", {"AWS_ENDPOINT_URL": "http://h", "AWS_ALLOW_HTTP": "no"}, "AWS_ALLOW_HTTP"),
        ("s3", {"AWS_ALLOW_INVALID_CERTIFICATES": "s3cr3t"}, "AWS_ALLOW_INVALID_CERTIFICATES"),
        ("gs", {"STORAGE_EMULATOR_HOST": "s3cr3t:4443"}, "STORAGE_EMULATOR_HOST"),
        (
            "az",
            {CONNECTION_STRING: "AccountName=a;AccountKey=s3cr3t!;BlobEndpoint=http://h/a"},
            CONNECTION_STRING,
        ),
        (
            "az",
            {"AZURE_STORAGE_ACCOUNT_NAME": "a", "AZURE_STORAGE_ACCOUNT_KEY": "s3cr3t!"},
            "AZURE_STORAGE_ACCOUNT_KEY",
        ),
        ("az", {"AZURE_STORAGE_USE_EMULATOR": "s3cr3t"}, "AZURE_STORAGE_USE_EMULATOR"),
        ("az", {}, CONNECTION_STRING),
    ],
)
def test_a_setting_that_cannot_work_is_named_never_repeated(scheme, env, names):
    with pytest.raises(StorageError) as info:
        _settings(scheme, env)
    assert names in str(info.value) and "s3cr3t" not in str(info.value)
    assert info.value.usage and "\n" not in str(info.value)


def test_the_client_options_are_the_librarys():
    # every option carried over is one the library takes from client_options
    from obstore.store import from_url

    sample = {
        "allow_http": "true",
        "allow_invalid_certificates": "false",
        "http1_only": "true",
        "http2_only": "false",
        "http2_keep_alive_while_idle": "true",
        "randomize_addresses": "true",
        "http2_max_frame_size": "16384",
        "pool_max_idle_per_host": "3",
        "proxy_url": "http://p:1",
        "proxy_ca_certificate": "x",
        "proxy_excludes": "a",
        "user_agent": "x",
        "default_content_type": "a/b",
    }
    for option in settingsmod.CLIENT_OPTIONS:
        from_url("s3://models", client_options={option: sample.get(option, "5s")})


def test_an_endpoint_whose_host_has_no_address_is_refused_at_once(setenv, monkeypatch):
    # the resolver's answer (no such name), not a failure to ask it (EAI_AGAIN: left to the
    # library, which tries again)
    def resolve(address, timeout=None):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "create_connection", resolve)
    setenv({"AWS_ENDPOINT_URL": "http://no-such-host.invalid:9000", **S3_KEYS})
    exc = refused(head("s3"), "AWS_ENDPOINT_URL", "no address")
    assert exc.usage


def test_behind_a_proxy_the_endpoint_is_not_tried_directly(monkeypatch):
    # through a proxy, a connection of our own would not tell whether the client gets there
    tried = []

    def connect(address, timeout=None):
        tried.append(address)
        return socket.socket()  # closed at once

    monkeypatch.setattr(socket, "create_connection", connect)
    loc = ObjectUrl.parse(url("s3"))
    env = {"AWS_ENDPOINT_URL": "http://127.0.0.1:9"}
    for proxy in ({"HTTPS_PROXY": "http://p:3128"}, {"http_proxy": "http://p:3128"}):
        _clean(monkeypatch, {})
        for name, value in proxy.items():
            monkeypatch.setenv(name, value)
        store_config.check_answers(settingsmod.store_settings(loc, env), loc, 1.0)
    store_config.check_answers(
        settingsmod.store_settings(loc, {**env, "AWS_PROXY_URL": "http://p:3128"}), loc, 1.0
    )
    assert tried == []
    _clean(monkeypatch, {})
    store_config.check_answers(settingsmod.store_settings(loc, env), loc, 1.0)
    assert tried == [("127.0.0.1", 9)]
