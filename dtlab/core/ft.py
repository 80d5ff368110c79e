"""Which replica group a process belongs to, under the ``ft`` launcher.

The launcher (``dtlab.launch.ft``) starts each replica group as a world of its
own and tells its ranks, in their environment, which group and which attempt
they are and where torchft's lighthouse listens; the tiers (``ft``, ``diloco``)
read it back with ``identity()``. Both sides take the names from here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

REPLICA_ENV, ATTEMPT_ENV = "DTLAB_FT_REPLICA", "DTLAB_FT_ATTEMPT"
REPLICAS_ENV, LIGHTHOUSE_ENV = "DTLAB_FT_REPLICAS", "DTLAB_FT_LIGHTHOUSE"
NODE_ADDR_ENV = "DTLAB_NODE_ADDR"  # a simulated host's address (set by the torchrun launcher)

# A replica group whose heartbeats stop for HEARTBEAT_TIMEOUT_MS is out of the lighthouse's next quorum: what a
# dead group costs the others. Each group's manager beats every HEARTBEAT_INTERVAL_MS from a Rust thread, which
# a busy Python does not delay, so six missed beats mean a dead process -- on one machine. (A live group left out
# by mistake only joins the next quorum, healing if it fell behind.) On a real cluster 300 ms evicts healthy
# groups: a congested or briefly partitioned link, a stalled host or a paused VM holds beats back that long, and
# each such group then loses its steps and heals from a peer, again and again on a flaky link. Clusters keep
# torchft's 5 s (timeouts="torchft"); the cost is that a dead group is noticed 5 s later.
HEARTBEAT_INTERVAL_MS = 50
HEARTBEAT_TIMEOUT_MS = 300


@dataclass(frozen=True)
class Timeouts:
    """How fast torchft notices a dead replica group: the managers' beat, and the lighthouse's three settings.

    ``heartbeat_timeout_ms``: beats missed this long, a group is out of the next quorum; ``join_timeout_ms``:
    how long a quorum that could form waits for groups that beat but have not asked yet; ``quorum_tick_ms``:
    how often the lighthouse looks again while it waits.
    """

    heartbeat_interval_ms: int
    heartbeat_timeout_ms: int
    join_timeout_ms: int
    quorum_tick_ms: int


# torchft 0.2.0's own defaults: the lighthouse's command line (``--heartbeat_timeout_ms`` 5000,
# ``--join_timeout_ms`` 60000, ``--quorum_tick_ms`` 100; LighthouseServer takes the same when given None) and
# ``torchft.Manager(heartbeat_interval=timedelta(milliseconds=100))``.
TORCHFT_TIMEOUTS = Timeouts(heartbeat_interval_ms=100, heartbeat_timeout_ms=5000, join_timeout_ms=60000,
                            quorum_tick_ms=100)
# dtlab's, tuned for a few groups on one machine: six missed beats are a dead group.
TUNED_TIMEOUTS = Timeouts(heartbeat_interval_ms=HEARTBEAT_INTERVAL_MS, heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS,
                          join_timeout_ms=HEARTBEAT_TIMEOUT_MS, quorum_tick_ms=20)
TIMEOUTS = {"torchft": TORCHFT_TIMEOUTS, "tuned": TUNED_TIMEOUTS}


def timeouts(name: str, field: str = "timeouts") -> Timeouts:
    """``"torchft"`` or ``"tuned"`` -> its Timeouts; a one-line ValueError naming ``field`` otherwise."""
    if name not in TIMEOUTS:
        raise ValueError(f"{field}={name!r} is invalid: choose one of {', '.join(map(repr, TIMEOUTS))} "
                         f"(torchft's own defaults, or dtlab's tuned ones)")
    return TIMEOUTS[name]


@dataclass(frozen=True)
class ReplicaIdentity:
    replica: int  # the replica group, 0..replicas-1
    attempt: int  # 0 at the first start, +1 at each restart of this group
    replicas: int
    lighthouse: str  # http://host:port
    host: str  # the address this group's servers bind (loopback, or its simulated host's)


def environment(replica: int, attempt: int, replicas: int, lighthouse: str) -> dict[str, str]:
    """The variables a replica group's ranks start with."""
    return {REPLICA_ENV: str(replica), ATTEMPT_ENV: str(attempt), REPLICAS_ENV: str(replicas),
            LIGHTHOUSE_ENV: lighthouse}


def identity() -> ReplicaIdentity:
    """This process's replica group; ValueError if it was not started by the ft launcher."""
    if REPLICA_ENV not in os.environ or LIGHTHOUSE_ENV not in os.environ:
        raise ValueError("this tier runs replica groups around torchft's lighthouse: start it with dtlab.run(cfg)")
    return ReplicaIdentity(int(os.environ[REPLICA_ENV]), int(os.environ.get(ATTEMPT_ENV, 0)),
                           int(os.environ.get(REPLICAS_ENV, 1)), os.environ[LIGHTHOUSE_ENV],
                           os.environ.get(NODE_ADDR_ENV, "127.0.0.1"))
