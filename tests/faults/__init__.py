"""Fault-injection tools shared by the chaos tests and benchmarks.

* :mod:`tests.faults.etcd_cluster`: a local multi-member etcd cluster whose
  members are SIGKILLed, stopped and restarted one by one.
* :mod:`tests.faults.netns`: a node in its own network namespace behind a
  veth link that can be cut (a partition) and healed.
* :mod:`tests.faults.processes`: ``ringmaster`` service processes (controller,
  agents), optionally inside a namespace, always cleaned up.
"""
