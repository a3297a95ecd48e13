"""The shared etcd core.

* ``client``: :class:`~orchestrator.etcd.client.EtcdClient` and ``connect``;
  every etcd call goes through it: the key-value facade over the parts below.
* ``transport``: every call's fail-over between members, retries, named
  refusals, and the outage bookkeeping (``unreachable_for``, silences, NOSPACE).
* ``ranges``: reads of a prefix in pages at one revision; trimming the oldest keys.
* ``transactions``: compare-and-set, fenced writes, many keys at once, write sizes.
* ``maintenance``: status, database sizes, alarms, compaction, defragmentation.
* ``options``: ``EtcdOptions`` (endpoints, TLS, credentials, timeouts).
* ``kv``: what the client hands out: ``KeyValue``, ``WatchEvent``, ``Watch``,
  ``Lease`` (with the one lease keep-alive loop).
* ``watch``: ``KeyFollower``, the one loop that follows a key or prefix through
  outages, resuming from the revision after the last one it saw.
* ``channel``: opening the etcd3 library's client of each member; the connect loop.
* ``members``: the members as a client sees them: which one calls go to, fail-over,
  per-attempt deadlines.
* ``quorum``: whether etcd has a quorum (a majority of members answering, with a
  leader), and where the leader is.
* ``diagnosis``: why etcd did not answer (TLS mismatch, refused credentials, no quorum),
  and the named refusals (request too large, NOSPACE).
* ``health``: how full etcd is (database size against the quota, alarms).
* ``compactor``: the leading controller's compaction of etcd's history every few seconds.
* ``retry``: jittered backoff and ``retry_unavailable`` for waiting out outages.
* ``grpc_env``: gRPC's environment for the processes ringmaster starts.
* ``embedded``, ``fencing``, ``leader``: a private etcd, generation-fenced
  writes, leader election.

This package's ``__init__`` imports nothing, so ``grpc_env`` can be applied
before gRPC is loaded.
"""
