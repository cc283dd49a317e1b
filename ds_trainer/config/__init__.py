"""Before a run, torch-free: the typed config groups, their checks, the DeepSpeed JSON, the run directory.

Nothing here imports torch, DeepSpeed, diffusers or Accelerate at module level: composing, checking
and writing `ds_config.json` (a dry run) takes well under a second.
"""
