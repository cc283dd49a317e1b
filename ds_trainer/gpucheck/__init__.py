"""`python -m ds_trainer.gpucheck --out DIR [--budget-s 500] [--cpu]`: check and measure ds_trainer on one GPU.

A fixed sequence of steps in priority order (the machine, correctness with the tiny models, the real-size SDXL
UNet, then Flux-dev if time remains), each in a process of its own under its own timeout, the whole within the
budget. After every step DIR/results.json and DIR/results.md are rewritten, so a check cut short keeps what it
measured. `--cpu` runs the same sequence with what a CPU can run (the tiny models). See docs/gpu-check.md.
"""


def main(argv: list[str] | None = None) -> int:
    """The command line (cli.main), importable from the package as the other commands' are."""
    from ds_trainer.gpucheck.cli import main as cli_main

    return cli_main(argv)
