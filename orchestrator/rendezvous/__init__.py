"""The torchrun rendezvous backend on etcd v3 and the c10d store it hands out."""
