"""DeepSpeed's ops the run loads are built, or can be compiled here (a C++ compiler, Python's headers, ninja):
asked last, of a config with no other problem, rather than minutes in at DeepSpeed's set-up. Torch-free, read-only.
(nvcc for the CUDA ops and libaio are asked where the fallback or the offload is decided.)
"""

from __future__ import annotations

from omegaconf import DictConfig

from ds_trainer.config import op_cache, toolkit
from ds_trainer.config.problems import Problem


def problems(cfg: DictConfig) -> list[Problem]:
    """The ops `toolkit.needed_ops` names that are neither built nor buildable here."""
    folder = op_cache.environment_folder()
    missing = toolkit.build_tools_missing()
    if not missing:
        return []
    unbuilt = [op for op in toolkit.needed_ops(cfg) if not toolkit.built(op, folder)]
    if not unbuilt:
        return []
    named = f"ops {', '.join(unbuilt)} are" if len(unbuilt) > 1 else f"op {unbuilt[0]} is"
    return [Problem("zero", f"stage{int(cfg.zero.stage)}", f"DeepSpeed's {named} not built in {folder} and "
                    f"this machine cannot compile them: missing {', '.join(missing)}", toolkit.BUILD_FIX)]
