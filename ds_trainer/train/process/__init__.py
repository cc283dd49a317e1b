"""The run's processes: imports, op builds, rendezvous across nodes, signals, out-of-memory advice."""
