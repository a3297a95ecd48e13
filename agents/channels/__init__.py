"""The local sockets between a node agent and its workers: both ends import these.

Each channel's wire format and its environment variable live in one module, so the
agent's side and the worker's side cannot drift apart.

The node's local wire formats, and why there is more than one:

* :mod:`~agents.channels.plan_feed`: a stream socket, one way (agent to worker),
  the newest value of the plan and control keys as binary frames (kind, etcd
  ``mod_revision``, length, then etcd's bytes unchanged).  Ordered, and a slow
  reader is dropped after a send timeout, so the agent never waits on a worker.
* :mod:`~agents.channels.progress`: JSON datagrams on one abstract Unix socket of
  the agent's, request and reply matched by a sequence number.  Connectionless on
  purpose: a frozen worker holds no connection and no buffer of the agent's, one
  socket serves every worker, and a lost beat is replaced by the next one.
* a restart-tier standby's one request (:mod:`agents.node.warm_standby`): one JSON
  line on its stdin pipe, which then closes; no socket at all.
* the agent's liveness port (:mod:`orchestrator.ports.liveness`) is not local: it is the
  controller's TCP connection to the agent, with a status line sent on connect (a
  probe needs no request) and JSON lines after it.

A shared framing layer would fit only the first of these: the others are a datagram,
a pipe read once, and a network protocol whose first line is its answer.
"""
