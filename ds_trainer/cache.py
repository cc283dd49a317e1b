"""`python -m ds_trainer.cache <overrides>`: build the latent cache ahead of training and stop (`cache_only=true`).

The same command line as training, under the same launchers: `torchrun --nproc-per-node 8 -m ds_trainer.cache ...`
splits the encoding over the ranks, `-m hydra/launcher=...` runs it as a Slurm job per node. Killed, it resumes
after its last whole pack of samples; a training run with the same data and model then finds the
cache complete and encodes nothing.
"""

import sys


def main() -> None:
    from ds_trainer.cli import main as cli_main

    cli_main([*sys.argv[1:], "cache_only=true"])


if __name__ == "__main__":
    import gc

    try:
        main()
    finally:
        gc.freeze()  # as ds_trainer/__main__.py: no full collection at exit
