"""Live training state after a failure: where a rank of a new generation gets its state.

Runs in the training process.  The tiers, best source first: a survivor's live
state (:mod:`~agents.recovery.state_sync`), a sharded model's twin replica or a
buddy's host-memory copy (:mod:`~agents.recovery.shard_transfer`,
:mod:`~agents.recovery.buddy_copies`, :mod:`~agents.recovery.shard_recovery`), and
last the durable checkpoint (:mod:`checkpoint`).
"""
