"""Shared fixtures: every test that launches ranks checks that none survive.

Tests that start processes (they use ``no_survivors`` or ``nothing_left``), run
notebooks or drive a browser are marked ``slow``: ``pytest -m "not slow"`` is
the quick inner loop, ``make test`` runs everything.
"""

from __future__ import annotations

import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import signal
import time
import uuid

import psutil
import pytest

# Every process this test session starts inherits this marker, however far down: another session's processes
# (a second engineer's suite, a learner's notebook) are never taken for this one's leftovers, nor killed as such.
SESSION_ENV = "DTLAB_TEST_SESSION"
os.environ[SESSION_ENV] = uuid.uuid4().hex


def ours(p: psutil.Process) -> bool:
    try:
        return p.environ().get(SESSION_ENV) == os.environ[SESSION_ENV]
    except psutil.Error:
        return False


def helper_pids() -> set[int]:
    """The idle forkserver and resource tracker kept by multiprocessing (allowed to stay)."""
    pids = {getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None),
            getattr(multiprocessing.resource_tracker._resource_tracker, "_pid", None)}
    return {p for p in pids if p}


def leftover_processes(wait_s: float = 3.0) -> list[psutil.Process]:
    """Descendants of this process other than the allowed helpers, after a short grace."""
    deadline = time.time() + wait_s
    while True:
        allowed = helper_pids()
        alive = [p for p in psutil.Process().children(recursive=True)
                 if p.pid not in allowed and p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not alive or time.time() > deadline:
            return alive
        time.sleep(0.1)


@pytest.fixture
def no_survivors():
    """Fails the test if any rank process outlives it."""
    yield
    alive = leftover_processes()
    names = [(p.pid, p.name(), " ".join(p.cmdline())[:80]) for p in alive]
    for p in alive:
        p.kill()
    assert not alive, f"processes left behind: {names}"


@pytest.fixture
def default_sigint():
    """SIGINT raises KeyboardInterrupt, as in a kernel: other tests' libraries (Playwright) may replace it."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def torchrun_processes(since: float = 0.0) -> list[psutil.Process]:
    """This session's torchrun agents and dtlab workers anywhere on the machine (orphans are not our descendants)
    started at ``since`` (a time.time()) or later: one started before a test cannot be that test's leftover."""
    found = []
    for p in psutil.process_iter(["cmdline", "create_time"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if ("dtlab.launch.worker" in cmd or "torch.distributed.run" in cmd) and p.info["create_time"] >= since \
                and ours(p):
            found.append(p)
    return found


@pytest.fixture
def nothing_left(no_survivors):
    """no_survivors, and no torchrun agent, dtlab worker or dtlab network namespace anywhere afterwards."""
    started = time.time() - 1.0  # create_time is rounded
    yield
    from dtlab.launch import netns

    deadline = time.time() + 5.0
    while (stray := torchrun_processes(started)) and time.time() < deadline:
        time.sleep(0.2)
    for p in stray:
        p.kill()
    assert not stray, f"torchrun processes left behind: {[' '.join(p.cmdline())[:80] for p in stray]}"
    if netns.available()[0]:  # this process's namespaces (named with its pid): not another session's
        mine = [n for n in netns.leftovers() if n.startswith(f"{netns.PREFIX}{os.getpid()}-")]
        assert mine == [], "network namespaces left behind"


_SLOW_FIXTURES = {"no_survivors", "nothing_left"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
