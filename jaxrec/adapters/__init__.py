"""What reads and writes the world for every tenant: the run store, the Kubernetes client, checkpoints, records."""
