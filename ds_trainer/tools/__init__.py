"""Tools around runs: the memory planner and the GPU benchmark."""
