"""The recoveries' table: for each kind of state a worker holds, the one that brings it back.

Runs in the training process.  The runtime picks from this table by the kind
of state the session holds (:attr:`agents.state.api.Holdings.kind`) each time
a worker joins a generation; it is handed the table by whoever builds the
session (:func:`agents.runtime.startup.init`), and never imports this package.
A new kind of state takes a module of its own here (a class with the
:class:`~agents.state.api.Recovery` ``join``) and one line of the table.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from agents.recovery.replicas import ReplicaRecovery
from agents.recovery.shard_recovery import SliceRecovery
from agents.recovery.site_join import SiteRecovery
from agents.recovery.site_shards import SiteSliceRecovery
from agents.state.api import REPLICAS, SITE_SLICES, SITES, SLICES, Recovery

__all__ = ["RECOVERIES"]

RECOVERIES: Mapping[str, Recovery] = MappingProxyType(
    {
        REPLICAS: ReplicaRecovery(),
        SLICES: SliceRecovery(),
        SITES: SiteRecovery(),
        SITE_SLICES: SiteSliceRecovery(),
    }
)
