"""What is kept in etcd and how: keyspace, typed records and their codec, jobs, runs, fences."""
