"""The node side, in two processes: the node daemon and the library training scripts import.

* :mod:`agents.node`: the node agent (``ringmaster agent``), its own process.
* :mod:`agents.runtime`: what a training script imports (``from agents import
  runtime``); with :mod:`agents.recovery` (live state after a failure, one
  recovery per kind of state), :mod:`agents.state` (the state both speak of,
  and their contract), :mod:`agents.sync` (delayed sync between sites) and
  :mod:`agents.comm` (gradient communication), it runs in the training process.
* :mod:`agents.channels`: the local sockets between the two, both ends.
* :mod:`agents.api`: the contracts they share (the worker's environment, errors).
"""

__all__: list[str] = []
