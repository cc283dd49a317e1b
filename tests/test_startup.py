"""The start-up line: where the time to the first step went, logged once."""

from __future__ import annotations

import logging
import time

import pytest

from ds_trainer.train import startup


def test_the_first_step_logs_each_part_once(caplog: pytest.LogCaptureFixture) -> None:
    assert startup.process_start() <= time.time()
    startup.mark("import")
    time.sleep(0.25)
    startup.mark("model build")
    with caplog.at_level(logging.INFO, logger="ds_trainer"):
        startup.first_step()
        startup.first_step()
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("start-up:")]
    assert "s to the end of the first step (import " in line
    build = float(line.split("model build ")[1].split(",")[0])
    assert build >= 0.2 and "first step" in line
