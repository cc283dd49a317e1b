"""`python -m ds_trainer.gpucheck --out DIR [--part N] [--mirror DIR] [--cpu]`: check and measure
ds_trainer on one GPU.

A fixed sequence of steps in priority order (the machine, correctness with the tiny models, the
real-size SDXL UNet, then Flux-dev if time remains), each in a process of its own under its own
timeout, split into two device calls of a budget each. After every step DIR/results.json and
DIR/results.md are rewritten (and copied to the mirror), so a call cut short keeps what it
measured. `--cpu` runs the same sequence with what a CPU can run (the tiny models);
`python -m ds_trainer.gpucheck.rehearse` runs the device calls here under the tool's limits. See
docs/gpu-check.md.
"""


def main(argv: list[str] | None = None) -> int:
    """The command line (cli.main), importable from the package as the other commands' are."""
    from ds_trainer.gpucheck.cli import main as cli_main

    return cli_main(argv)
