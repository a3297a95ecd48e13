"""The local sockets between a node agent and its workers: both ends import these.

Each channel's wire format and its environment variable live in one module, so the
agent's side and the worker's side cannot drift apart.
"""
