"""Before a run, torch-free: the typed config groups, validation, the DeepSpeed JSON, the run directory.

Nothing here imports torch, DeepSpeed, diffusers or Accelerate at module level: composing, validating
and writing `ds_config.json` (a dry run) takes well under a second.
"""
