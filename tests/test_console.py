"""The terminal filter of ds_trainer/console.py: the known messages leave it, nothing else of a library does."""

from __future__ import annotations

import io
import logging
import warnings
from pathlib import Path

import pytest

from ds_trainer import console


def test_known_library_messages_go_to_the_log_file_and_every_other_warning_stays_on_the_terminal(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(console._FILTER, "seen", set())  # as a fresh process: other tests here may have seen them
    terminal = io.StringIO()
    screen = logging.StreamHandler(terminal)
    screen.addFilter(console.ConsoleFilter())
    log_file = logging.FileHandler(tmp_path / "run.log")
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    root.handlers[:] = [screen, log_file]
    root.setLevel(logging.INFO)
    try:
        console.install()
        console.adopt()  # as a run does once the libraries are imported
        deepspeed = logging.getLogger("DeepSpeed")
        for _ in range(3):
            deepspeed.warning("Attempting to get learning rate from scheduler before it has started")
        deepspeed.warning("Attempting to get learning rate from scheduler before it has started, and more")
        logging.getLogger("diffusers.models.modeling_utils").warning(
            "There are modules in AutoencoderKL that should be kept in float32: []. Casting directly ...")
        logging.getLogger("diffusers.models.modeling_utils").warning(
            "There are modules in AutoencoderKL that should be kept in float32: ['quant_conv']. Casting ...")
        logging.getLogger("accelerate.accelerator").info("Saving current state to somewhere")
        logging.getLogger("ds_trainer").info("our own line")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn_explicit("`torch.distributed.reduce_scatter_tensor` is deprecated", FutureWarning,
                                   "/x/torch/distributed/c10d_logger.py", 83)
            warnings.warn_explicit("something new", FutureWarning, "/x/torch/distributed/c10d_logger.py", 83)
    finally:
        logging.captureWarnings(False)
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
        log_file.close()
    shown = terminal.getvalue().splitlines()
    written = (tmp_path / "run.log").read_text()
    # Known: in the log file once each, not on the terminal. A longer message of the same logger, a non-empty
    # list of float32 modules, a new warning from the same file: on the terminal. Another library's INFO: file.
    assert written.count("before it has started\n") == 1 and "reduce_scatter_tensor" in written
    assert shown[:4] == ["Attempting to get learning rate from scheduler before it has started, and more",
                         "There are modules in AutoencoderKL that should be kept in float32: ['quant_conv']. "
                         "Casting ...", "our own line", "/x/torch/distributed/c10d_logger.py:83: FutureWarning: "
                         "something new"]
    assert "".join(shown[4:]).strip() == "" and "Saving current state" in written
