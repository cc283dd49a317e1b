"""Inside a run: the training recipe (`recipe.py`) and the parts it calls (models, data, the step,
checkpoints, EMA, metrics, Accelerate wiring)."""
