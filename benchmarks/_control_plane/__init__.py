"""Parts of ``benchmarks/control_plane.py``: etcd and its metrics, the simulated fleet, probes."""
