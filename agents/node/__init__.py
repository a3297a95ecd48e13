"""The node daemon (``ringmaster agent``): runs in the agent's own process, never imports torch.

One agent per node registers the node, starts and supervises its workers (each in a
process group of its own), relays their progress and break reports to etcd, and
passes them the plan.  The restart tier (any torchrun script, restarted per
generation) lives here too.  Nothing in this package runs inside a training process
except :mod:`agents.node.warm_standby`, the program a pre-imported standby runs
before it becomes the user's script.
"""
