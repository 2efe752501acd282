"""A readers-writer lock for threads: many searches at once, or one write's visibility change."""
from __future__ import annotations

import threading


class _Side:
    """`with lock.read():` / `with lock.write():` without a generator per use: every search
    takes the read side once, so the lock is on the hot path (a @contextmanager cost ~10 us)."""

    __slots__ = ("acquire", "release")

    def __init__(self, acquire, release):
        self.acquire, self.release = acquire, release

    def __enter__(self):
        self.acquire()

    def __exit__(self, *exc):
        self.release()


class RWLock:
    """Writer-preferring: once a writer waits, new readers queue behind it (writes never starve)."""

    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._writer = False
        self._waiting_writers = 0
        self._read = _Side(self._acquire_read, self._release_read)
        self._write = _Side(self._acquire_write, self._release_write)

    def read(self) -> _Side:
        return self._read

    def write(self) -> _Side:
        return self._write

    def _acquire_read(self) -> None:
        with self._cond:
            while self._writer or self._waiting_writers:
                self._cond.wait()
            self._readers += 1

    def _release_read(self) -> None:
        with self._cond:
            self._readers -= 1
            if self._readers == 0 and self._waiting_writers:
                self._cond.notify_all()

    def _acquire_write(self) -> None:
        with self._cond:
            self._waiting_writers += 1
            while self._writer or self._readers:
                self._cond.wait()
            self._waiting_writers -= 1
            self._writer = True

    def _release_write(self) -> None:
        with self._cond:
            self._writer = False
            self._cond.notify_all()
