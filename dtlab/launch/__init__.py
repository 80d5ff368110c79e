"""Starting ranks: dtlab's local launcher, torchrun agents, RPC workers, simulated hosts and clusters.

Every launcher keeps one contract (``dtlab.launch.contract``): it takes ``LaunchOptions``
and returns a ``LaunchResult``.
"""

from dtlab.launch.contract import LaunchOptions, LaunchResult, LaunchStopped
from dtlab.launch.local import launch, shutdown

__all__ = ["LaunchOptions", "LaunchResult", "LaunchStopped", "launch", "shutdown"]
