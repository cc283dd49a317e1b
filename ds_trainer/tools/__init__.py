"""Tools around runs: the memory planner (`plan/`), the tuner (`tune/`), the benchmark (`bench/`), the doctor, the
checkpoint converter and the op builder."""
