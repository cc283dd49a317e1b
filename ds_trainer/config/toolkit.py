"""Can this machine compile DeepSpeed's CUDA ops? Found without importing torch or DeepSpeed (a dry run stays fast).

DeepSpeed compiles FusedAdam (and FusedLamb, FusedLion) with nvcc at a run's first step. pip's CUDA torch brings
the CUDA runtime but no compiler, so on most fresh GPU machines that first step fails ("CUDA_HOME does not exist",
"Error building extension 'fused_adam'"), or DeepSpeed refuses a toolkit whose version is not torch's. The rules
here are DeepSpeed 0.19's (`ops/op_builder/builder.py`, read from the installed file): CUDA_HOME found as torch
finds it, nvcc's release equal to torch's CUDA in major.minor or both in DeepSpeed's `cuda_minor_mismatch_ok`,
`DS_SKIP_CUDA_CHECK=1` accepting any. Ops DeepSpeed was installed with (`DS_BUILD_OPS=1`) need no compiler.
On the CUDA accelerator the CPU-offload optimizers (cpu_adam, cpu_adagrad, cpu_lion) and async_io are plain
C++: they need a C++ compiler, not nvcc.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The CUDA op each GPU-resident optimizer of DeepSpeed compiles (an optimizer state offloaded to the host uses
# DeepSpeed's C++ CPU op instead; adagrad on the GPU is torch's own).
CUDA_OPS = {"adam": "fused_adam", "adamw": "fused_adam", "lamb": "fused_lamb", "lion": "fused_lion"}


@dataclass(frozen=True)
class Toolkit:
    torch_cuda: str | None  # the CUDA torch was built with ("12.8"); None: a CPU or ROCm build
    cuda_home: str | None  # as torch finds it: CUDA_HOME, CUDA_PATH, nvcc on PATH, /usr/local/cuda
    nvcc: str | None  # nvcc's release ("12.4"); None when there is no nvcc to run
    minor_mismatch_ok: dict[int, list[str]]
    prebuilt: frozenset[str]  # ops compiled into the installed DeepSpeed

    @property
    def problem(self) -> str | None:
        """Why DeepSpeed cannot compile a CUDA op here, or None when it can."""
        if self.cuda_home is None:
            return ("no CUDA toolkit: CUDA_HOME and CUDA_PATH are unset, no nvcc is on PATH and there is no "
                    "/usr/local/cuda (pip's CUDA torch brings the runtime, not the compiler)")
        if self.nvcc is None:
            return f"{self.cuda_home}/bin/nvcc cannot be run (CUDA_HOME points at a runtime-only install?)"
        if self.torch_cuda is None:
            return "the installed torch is a CPU build: it cannot run CUDA ops at all"
        if self.nvcc != self.torch_cuda and os.environ.get("DS_SKIP_CUDA_CHECK", "0") != "1":
            major = int(self.nvcc.split(".")[0])
            same_family = self.nvcc in self.minor_mismatch_ok.get(major, []) and \
                self.torch_cuda in self.minor_mismatch_ok.get(major, [])
            if not same_family:
                return (f"the CUDA toolkit at {self.cuda_home} is {self.nvcc} and torch was built with CUDA "
                        f"{self.torch_cuda}; DeepSpeed refuses to compile against another release")
        return None

    def fix(self) -> str:
        if self.torch_cuda is None:
            return ("install a CUDA build of torch (pip install torch --index-url "
                    "https://download.pytorch.org/whl/cu128) and the CUDA toolkit of the same release")
        return (f"install the CUDA toolkit {self.torch_cuda} (NVIDIA's cuda-toolkit-{self.torch_cuda.replace('.', '-')}"
                f" package, or `conda install -c nvidia cuda-nvcc={self.torch_cuda}`) and export CUDA_HOME=<its "
                f"folder>")

    def can_compile(self, op: str) -> bool:
        return op in self.prebuilt or self.problem is None


def _module_dir(name: str) -> Path | None:
    """The folder of an installed package, without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _assigned(path: Path, name: str) -> Any:
    """The literal assigned to `name` at the top of a Python file (None when absent or not a literal)."""
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        targets: list[ast.expr]
        value: ast.expr | None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign):
            targets, value = [node.target], node.value
        else:
            continue
        if any(isinstance(t, ast.Name) and t.id == name for t in targets) and value is not None:
            try:
                return ast.literal_eval(value)
            except ValueError:
                return None
    return None


def torch_cuda_version() -> str | None:
    """torch.version.cuda ("12.8"), read from torch/version.py without importing torch."""
    folder = _module_dir("torch")
    value = _assigned(folder / "version.py", "cuda") if folder else None
    return ".".join(str(value).split(".")[:2]) if value else None


def cuda_home() -> str | None:
    """Where torch's extension builder looks for the toolkit (torch.utils.cpp_extension._find_cuda_home)."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        return home
    nvcc = shutil.which("nvcc")
    if nvcc:
        return str(Path(nvcc).parent.parent)  # as torch does: no symlink resolved
    return "/usr/local/cuda" if Path("/usr/local/cuda").exists() else None


def nvcc_release(home: str) -> str | None:
    try:
        out = subprocess.run([f"{home}/bin/nvcc", "-V"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"release (\d+)\.(\d+)", out)
    return f"{match.group(1)}.{match.group(2)}" if match else None


@functools.cache
def probe() -> Toolkit:
    deepspeed = _module_dir("deepspeed")
    mismatch = _assigned(deepspeed / "ops" / "op_builder" / "builder.py", "cuda_minor_mismatch_ok") if deepspeed \
        else None
    installed = _assigned(deepspeed / "git_version_info_installed.py", "installed_ops") if deepspeed else None
    home = cuda_home()
    return Toolkit(torch_cuda=torch_cuda_version(), cuda_home=home, nvcc=nvcc_release(home) if home else None,
                   minor_mismatch_ok=mismatch or {},
                   prebuilt=frozenset(k for k, v in (installed or {}).items() if v))


def cxx_compiler() -> str | None:
    """The C++ compiler torch's extension builder would use (CXX, else c++), or None."""
    return shutil.which(os.environ.get("CXX", "c++"))


def needed_ops(cfg: Any) -> list[str]:
    """DeepSpeed's ops a checked configuration loads (by the folder names torch's loader builds them in)."""
    r = cfg.resolved
    if r.backend != "deepspeed":
        return []
    on_gpu, cpu = r.optimizer_state_on == "gpu", r.platform == "cpu"
    ops = []
    if on_gpu and not r.torch_adam:
        op = CUDA_OPS.get(r.optimizer) if not cpu else {"adam": "fused_adam", "adamw": "fused_adam"}.get(r.optimizer)
        ops += [op] if op else []
    elif not on_gpu:
        ops.append({"adagrad": "cpu_adagrad", "lion": "cpu_lion"}.get(r.optimizer, "cpu_adam"))
    if "nvme" in (r.optimizer_state_on, r.params_on):
        ops.append("async_io")
    if cpu:
        ops.append("deepspeed_shm_comm")  # DeepSpeed's CPU accelerator loads it at start-up
    return ops


def build_tools_missing() -> list[str]:
    """What torch's extension builder needs for a C++ op that this machine lacks."""
    import sys
    import sysconfig

    headers = Path(sysconfig.get_paths()["include"], "Python.h").exists()
    ninja = shutil.which("ninja") is not None or Path(sys.executable).with_name("ninja").exists()
    return [what for ok, what in ((cxx_compiler(), "a C++ compiler (CXX or c++)"),
                                  (headers, "Python's headers (Python.h)"), (ninja, "ninja")) if not ok]


def triton_tools_missing() -> list[str]:
    """What Triton lacks here to build the launcher of its kernels at their first use
    (triton/runtime/build.py: a C compiler, CC or else gcc or clang on PATH, and Python's
    headers): inductor's compiled steps, optimi's Kahan kernels, DeepSpeed's compiled Muon."""
    import sysconfig

    missing = []
    cc = os.environ.get("CC")
    if cc and shutil.which(cc) is None:
        missing.append(f"the C compiler CC names ({cc})")
    if not cc and shutil.which("gcc") is None and shutil.which("clang") is None:
        missing.append("a C compiler (gcc or clang on PATH, or CC)")
    if not Path(sysconfig.get_paths()["include"], "Python.h").exists():
        missing.append("Python's headers (Python.h)")
    return missing


def built(op: str, folder: Path) -> bool:
    """Whether `op` is compiled already: into the installed DeepSpeed, or in this environment's ops folder."""
    return op in probe().prebuilt or any((folder / op).glob("*.so"))


BUILD_FIX = ("apt-get install g++ python3-dev libaio-dev (and pip install ninja), then `make ops`; or zero=ddp, which "
             "loads no DeepSpeed op")
