"""Launching and watching runs: sweeps, the local Slurm cluster, the Hydra launcher plugin, reports."""
