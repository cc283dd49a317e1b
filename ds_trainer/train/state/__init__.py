"""What a run keeps and restores: checkpoints, their portable state, resumes, the EMA, content hashes."""
