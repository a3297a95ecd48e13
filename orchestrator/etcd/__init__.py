"""The shared etcd core: client, connection diagnosis, leases, watches, retry,
the embedded etcd, generation fencing and leader election."""
