"""The optimizers ds_trainer builds beside DeepSpeed's, their LR schedules and 8-bit state."""
