"""A ringmaster job inside a Slurm allocation: the batch script, the driver, the agents.

``ringmaster slurm script`` / ``submit`` write the batch script
(:mod:`orchestrator.slurm.script`, pure); inside the allocation the script runs
the driver (:mod:`orchestrator.slurm.allocation`: etcd, the controller, one
agent per node with ``srun``), and each agent runs with a watch on its node's
Slurm state (:mod:`orchestrator.slurm.node_agent`).  Every call to a Slurm
command is in :mod:`orchestrator.slurm.commands`; the contracts in
:mod:`orchestrator.slurm.api`.
"""
