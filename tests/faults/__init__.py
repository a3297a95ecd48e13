"""Fault-injection tools shared by the chaos tests: etcd clusters, network namespaces."""
