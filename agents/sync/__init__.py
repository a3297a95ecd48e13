"""Delayed synchronisation between sites: DiLoCo and Streaming DiLoCo (training process).

The job file's ``sync`` section (:mod:`orchestrator.spec.sync`) chooses it.
:mod:`agents.sync.sites` says which ranks form each site,
:mod:`agents.sync.site_groups` forms their process groups,
:mod:`agents.sync.schedule` when each fragment syncs,
:mod:`agents.sync.outer_step` the arithmetic of the outer step,
:mod:`agents.sync.quantize` how pseudo-gradients travel,
:mod:`agents.sync.outer_sync` the outer loop of one worker (tracked state),
:mod:`agents.sync.rounds` the rules of an outer sync's round between sites,
:mod:`agents.sync.round_exchange` a round's run and
:mod:`agents.sync.round_media` where its records and bytes are kept
(:mod:`agents.sync.round_etcd` in a job).
The worker runtime (:mod:`agents.runtime`) drives them at each step
(:mod:`agents.runtime.participants`); how a new generation brings each site to
its own state is recovery's (:mod:`agents.recovery.site_join`,
:mod:`agents.recovery.site_shards`).
"""
