"""Live training state after a failure: where a rank of a new generation gets its state.

Runs in the training process.  One :class:`~agents.state.api.Recovery` per
kind of state a worker holds, in the table the runtime picks from
(:data:`agents.recovery.kinds.RECOVERIES`):

* DDP replicas (:mod:`~agents.recovery.replicas`): a survivor's live state
  (:mod:`~agents.recovery.state_sync`, :mod:`~agents.recovery.tensor_stream`);
* a sharded model's slices (:mod:`~agents.recovery.shard_recovery`): from a
  twin replica, a buddy's host-memory copy or the rank itself
  (:mod:`~agents.recovery.shard_transfer`, :mod:`~agents.recovery.slice_state`);
* sites under a delayed sync, of a DDP model (:mod:`~agents.recovery.site_join`)
  or of an FSDP2 model (:mod:`~agents.recovery.site_shards`,
  :mod:`~agents.recovery.site_plan`, :mod:`~agents.recovery.outer_reshard`);

and last, for each, the durable checkpoint (:mod:`checkpoint`).  It imports
the contract and the sharded model's vocabulary (:mod:`agents.state`) and the
delayed sync (:mod:`agents.sync`), never the runtime (:mod:`agents.runtime`).
"""
