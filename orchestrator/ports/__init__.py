"""The node agents' ports as the control plane asks them: liveness, requests, link probes."""
