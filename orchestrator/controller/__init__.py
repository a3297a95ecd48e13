"""The controller: reads the world from etcd, decides (pure policy), applies the decisions."""
