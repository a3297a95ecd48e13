"""The training state a worker holds in memory, as the runtime and recovery both speak of it.

Runs in the training process.  One floor below :mod:`agents.runtime` (which
trains with this state) and :mod:`agents.recovery` (which brings it back
after a failure); neither of those imports the other, and this package
imports neither.

* :mod:`agents.state.api`: the contract between them: the kinds of state a
  worker holds (DDP replicas, a sharded model's slices, sites), what a join
  hands the :class:`~agents.state.api.Recovery` of a kind, and what it
  returns.
* A sharded model and its vocabulary: :mod:`agents.state.sharding` (the
  model rebuilt per generation, its slices), :mod:`agents.state.mesh_layout`
  (where each rank sits), :mod:`agents.state.tensor_plan` (tensor parallel),
  :mod:`agents.state.pipeline` (pipeline stages),
  :mod:`agents.state.replica_barrier`, :mod:`agents.state.sharded_timing`,
  :mod:`agents.state.tracked_optimizers` (the optimizers beside it), and
  :mod:`agents.state.buddy_copies` (each slice's copy in a buddy's memory).
"""

__all__: list[str] = []
