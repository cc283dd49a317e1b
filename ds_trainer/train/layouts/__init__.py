"""The makers' layouts of the models' weights (single files) and of LoRA files (kohya's names): pure renaming of
tensors, no run, no model (train/export writes the files, tools/convert converts older runs')."""
