"""Backends that misbehave on purpose, for the hardening tests and the soak."""
from __future__ import annotations

import os
import random
import signal
import threading
import time

from xpool.backends import DeviceOutOfMemory
from xpool_twin import TwinBackend


# The CI tier runs the soaks and the largest hypothesis searches smaller; `pytest --deep` (or XPOOL_TESTS_DEEP=1,
# `make test-deep`) runs them at full size, as before a release.
DEEP = os.environ.get("XPOOL_TESTS_DEEP", "").strip().lower() not in ("", "0", "no", "off", "false")


def soak_ops(ops: int) -> int:
    """A soak's operations per worker: `ops` in the deep tier, at most 2,000 in CI's."""
    return ops if DEEP else min(ops, 2000)


def examples(n: int) -> int:
    """A hypothesis search's examples: `n` in the deep tier, a quarter of it (at least 50) in CI's."""
    return n if DEEP else max(50, n // 4)


class InjectedFault(RuntimeError):
    """A failure the test asked the backend for."""


class FaultyBackend(TwinBackend):
    """The host twin's backend (TwinBackend) that fails and stalls on request; its own accounting stays exact.

    Args:
        malloc_oom: probability that malloc raises DeviceOutOfMemory (the pool's recovery ladder).
        malloc_error: probability that malloc raises InjectedFault (passed straight to the caller).
        free_error: probability that free raises InjectedFault, freeing nothing (the contract).
        malloc_delay, free_delay: seconds to sleep inside malloc (before taking memory) and free
            (before giving it back), with the GIL released: the windows where the pool's lock is dropped.
        seed: for the random failures.
    """

    def __init__(self, *, malloc_oom=0.0, malloc_error=0.0, free_error=0.0, malloc_delay=0.0,
                 free_delay=0.0, seed=0, **kw):
        super().__init__(**kw)
        self.malloc_oom, self.malloc_error, self.free_error = malloc_oom, malloc_error, free_error
        self.malloc_delay, self.free_delay = malloc_delay, free_delay
        self._rng = random.Random(seed)
        self._faults_lock = threading.Lock()   # guards _rng, fail_frees and the counts below
        self.fail_frees = 0                    # the next this-many frees raise, whatever the rates
        self.injected = {"malloc_oom": 0, "malloc_error": 0, "free_error": 0}
        self.free_calls = 0

    def _fault(self, kind: str, rate: float) -> bool:
        with self._faults_lock:
            hit = rate > 0 and self._rng.random() < rate
            if kind == "free_error" and self.fail_frees > 0:
                self.fail_frees -= 1
                hit = True
            self.injected[kind] += hit
            return hit

    def malloc(self, device: int, nbytes: int) -> int:
        if self.malloc_delay:
            time.sleep(self.malloc_delay)
        if self._fault("malloc_oom", self.malloc_oom):
            raise DeviceOutOfMemory(f"injected: device {device} refused {nbytes} B")
        if self._fault("malloc_error", self.malloc_error):
            raise InjectedFault(f"injected: malloc of {nbytes} B on device {device} failed")
        return super().malloc(device, nbytes)

    def free(self, device: int, ptr: int, nbytes: int) -> None:
        with self._faults_lock:
            self.free_calls += 1
        if self._fault("free_error", self.free_error):
            raise InjectedFault(f"injected: free of 0x{ptr:x} on device {device} failed")
        if self.free_delay:
            time.sleep(self.free_delay)
        super().free(device, ptr, nbytes)


class AddressBackend:
    """A backend with no memory behind it: every malloc gets a new address (fill/read unsupported)."""

    def __init__(self, n_devices: int = 1):
        self.n_devices = n_devices
        self._next = 1 << 20
        self.live: dict[int, tuple[int, int]] = {}

    def malloc(self, device, nbytes):
        ptr, self._next = self._next, self._next + nbytes
        self.live[ptr] = (device, nbytes)
        return ptr

    def free(self, device, ptr, nbytes):
        assert self.live.pop(ptr) == (device, nbytes)

    def fill(self, device, ptr, nbytes, byte):
        raise NotImplementedError("no memory behind these addresses")

    def read(self, device, ptr, nbytes):
        raise NotImplementedError("no memory behind these addresses")

    def current_device(self):
        return 0

    def current_stream(self):
        return 0

    def device_count(self):
        return self.n_devices

    def total_memory(self, device):
        return 1 << 40


def in_child(check, timeout_s: int = 20) -> str:
    """Run check() in a fork()ed child; its answer ('ok' or what went wrong) comes back through a pipe.

    A child that hangs is killed by SIGALRM after timeout_s and answers ''."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            signal.alarm(timeout_s)
            try:
                answer = check()
            except BaseException as e:  # noqa: BLE001 - reported to the parent
                answer = f"raised {e!r}"
            os.write(w, answer.encode()[:1000])
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        answer = f.read().decode()
    os.waitpid(pid, 0)
    return answer
