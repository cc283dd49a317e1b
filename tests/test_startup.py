"""The start-up line: where the time to the first step went, logged once."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.cli import run_cli
from helpers.deps import require

from ds_trainer.train.observe import startup


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


# --- DeepSpeed's op build locks (train/op_builds.py)

def _holding(lock: Path) -> subprocess.Popen:
    """Another process that holds `lock` open, as torch's loader does while it builds or loads an op."""
    proc = subprocess.Popen([sys.executable, "-c", f"import os, sys, time; os.open({str(lock)!r}, os.O_RDONLY); "
                             "print('open', flush=True); time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "open"
    return proc


def test_a_lock_nobody_holds_is_removed_and_a_held_one_is_left(tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    from ds_trainer.train.process import op_builds

    dead, busy, mine = (tmp_path / name / "lock" for name in ("cpu_adam", "fused_adam", "async_io"))
    for lock in (dead, busy, mine):
        lock.parent.mkdir()
        lock.touch()
    holder = _holding(busy)
    fd = os.open(mine, os.O_RDONLY)  # this process holds it: a compile in progress
    try:
        watcher = op_builds.Watcher(tmp_path)
        assert not watcher.shared  # pytest's tmp is on a local disk
        now = time.time()
        with caplog.at_level(logging.WARNING, logger="ds_trainer"):
            watcher.check(now)
            watcher.check(now + op_builds.STALE_AFTER_S - 1)
            assert dead.exists()  # not yet: a lock may be between its holder's close and its removal
            watcher.check(now + op_builds.STALE_AFTER_S + 1)
        assert not dead.exists() and busy.exists() and mine.exists()
        messages = [r.getMessage() for r in caplog.records]
        assert any(m.startswith(f"removed {dead}: a build lock of DeepSpeed's op cpu_adam") for m in messages)
        (compiling,) = [m for m in messages if m.startswith("compiling")]
        assert "op async_io" in compiling and "TORCH_EXTENSIONS_DIR" in compiling and "make ops" in compiling
        # The folder reached through a symbolic link (a home on another disk): the holder is still seen.
        (tmp_path.parent / f"{tmp_path.name}-link").symlink_to(tmp_path)
        linked = op_builds.Watcher(tmp_path.parent / f"{tmp_path.name}-link")
        linked.check(now)
        linked.check(now + op_builds.STALE_AFTER_S + 1)
        assert busy.exists()
        # On a network file system another node may be the builder: only a very old lock goes.
        dead.touch()
        shared = op_builds.Watcher(tmp_path)
        shared.shared = True
        shared.check(now)
        shared.check(now + 60)
        assert dead.exists()
    finally:
        os.close(fd)
        holder.kill()
        holder.wait()


@pytest.mark.slow
def test_a_run_starts_although_a_killed_process_left_an_op_build_lock(workdir: Path) -> None:
    # Without the watcher this run waits for the lock forever: torch's loader has no time limit.
    from ds_trainer.config import op_cache
    from ds_trainer.train.process import op_builds

    root = workdir / "torch_extensions"
    extensions = root / op_cache.environment_tag()  # the run builds and loads this environment's ops there
    extensions.mkdir(parents=True)
    for op in ("fused_adam", "deepspeed_shm_comm"):  # what a ZeRO-2 run loads (built by now, or built here)
        if (op_builds.extensions_root() / op).is_dir():
            shutil.copytree(op_builds.extensions_root() / op, extensions / op)
    (extensions / "fused_adam").mkdir(exist_ok=True)
    (extensions / "fused_adam" / "lock").touch()
    result = run_cli("zero=stage2", "train.max_steps=1", "data.num_samples=2", "logger=none", "train.export=false",
                     cwd=workdir, env={"TORCH_EXTENSIONS_DIR": str(root)}, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"removed {extensions / 'fused_adam' / 'lock'}: a build lock of DeepSpeed's op fused_adam" in result.stderr


# --- what a start-up no longer pays for (config/op_cache.py)

def test_each_python_environment_builds_its_ops_in_a_folder_of_its_own(tmp_path: Path) -> None:
    """Two venvs with their own DeepSpeed used to rebuild each other's ops in one shared folder (146 s at a
    start); the folder is now named after the environment, under the root the user chose."""
    code = ("import os; from ds_trainer.config import op_cache; print(op_cache.use_environment_folder()); "
            "print(op_cache.use_environment_folder()); print(os.environ['TORCH_EXTENSIONS_DIR'])")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    here = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    first, again, exported = here.stdout.split()
    assert first == again == exported and Path(first).parent == tmp_path  # idempotent, under the user's root
    # The same interpreter seen as another environment (another sys.prefix, as a venv has) gets another folder.
    other = subprocess.run([sys.executable, "-c", "import sys; sys.prefix = '/elsewhere/venv'; " + code], env=env,
                           capture_output=True, text=True, check=True)
    assert other.stdout.split()[0] != first and Path(other.stdout.split()[0]).parent == tmp_path
    # A process started by a ds_trainer process keeps the folder it inherited (no folder inside the folder).
    child = subprocess.run([sys.executable, "-c", code], env={**env, "TORCH_EXTENSIONS_DIR": first},
                           capture_output=True, text=True, check=True)
    assert child.stdout.split()[0] == first


def test_an_environment_reached_through_a_symlink_compiles_its_ops_with_the_same_commands(tmp_path: Path) -> None:
    """torch's loader rebuilds an op whose build commands changed, and the commands hold torch's and DeepSpeed's
    folders: the same environment reached through a link (a symlinked checkout or venv) must give the same
    commands, or each path rebuilds the ops the other one built (a minute or two per op)."""
    import torch

    site = Path(torch.__file__).resolve().parent.parent
    (tmp_path / "site").symlink_to(site, target_is_directory=True)
    code = ("import ds_trainer, torch, torch.utils.cpp_extension as ext; from ds_trainer.config import op_cache; "
            "from deepspeed.ops.op_builder.cpu import CPUAdamBuilder; b = CPUAdamBuilder(); "
            "print(torch.__file__); print(ext.include_paths()); print(b.strip_empty_entries(b.include_paths())); "
            "print(b.absolute_name(), [b.deepspeed_src_path(s) for s in b.sources()]); "
            "print(op_cache.environment_folder())")
    def run(code: str, **env: str) -> list[str]:  # what the code printed, without DeepSpeed's log lines
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, **env}).stdout
        return [line for line in out.splitlines() if not line.startswith("[20")]

    plain, linked = run(code), run(code, PYTHONPATH=str(tmp_path / "site"))
    without = run(code.replace("import ds_trainer, ", "import "), PYTHONPATH=str(tmp_path / "site"))
    assert str(tmp_path) in without[0]  # the link is what Python imports through when nothing resolves it
    assert linked == plain and str(site / "torch" / "include") in plain[1] and str(tmp_path) not in str(linked)


def test_the_cpu_description_is_probed_once_per_kind_of_cpu(tmp_path: Path) -> None:
    """DeepSpeed asks py-cpuinfo twice per op load (about 1.1 s a call); the answer is kept in a file."""
    code = ("import time, cpuinfo; from ds_trainer.config import op_cache; op_cache.cache_cpu_info(); "
            "t = time.perf_counter(); a = cpuinfo.get_cpu_info(); b = cpuinfo.get_cpu_info(); "
            "print(round(time.perf_counter() - t, 3), a['arch'] == b['arch'] == 'X86_64', 'flags' in a)")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    second = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    (cached,) = (tmp_path / "ds_trainer").glob("cpuinfo-*.json")
    assert first.stdout.split()[1:] == second.stdout.split()[1:] == ["True", "True"]
    assert float(second.stdout.split()[0]) < 0.1 <= float(first.stdout.split()[0])  # the probe ran once, in the first
    assert cached.stat().st_size > 100


def test_ops_compile_without_debug_information_in_every_process_that_loads_them() -> None:
    """DeepSpeed compiles its ops with -g (40% of the compile time, nobody reads it); torch rebuilds an op whose
    flags changed, so every entry point must compile them the same way: `prepare` leaves -g out, idempotently."""
    code = ("from ds_trainer.config import op_cache; op_cache.prepare(); op_cache.prepare(); "
            "from deepspeed.ops.op_builder.cpu import CPUAdamBuilder; b = CPUAdamBuilder(); "
            "print(b.strip_empty_entries(b.cxx_args()))")
    lean = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    stock = subprocess.run([sys.executable, "-c", code.replace("op_cache.prepare(); ", "")], capture_output=True,
                           text=True, check=True).stdout
    assert "'-g'" in stock and "'-g'" not in lean and "'-O3'" in lean


def test_ops_build_with_the_environments_own_ninja_whatever_path_the_process_got() -> None:
    """A process started without the environment's bin/ on PATH (its python called by path) builds with the same
    ninja as one started under `make`: two ninja versions read each other's build log as out of date."""
    here = Path(sys.executable).parent
    require((here / "ninja").exists(), f"no ninja beside {sys.executable} (make setup installs it)")
    code = "from ds_trainer.config import op_cache; import shutil; op_cache.prepare(); print(shutil.which('ninja'))"
    for path in ("/usr/bin:/bin", f"{here}:/usr/bin:/bin"):
        found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                               env={**os.environ, "PATH": path}).stdout.strip().splitlines()[-1]
        assert found == str(here / "ninja"), (path, found)


def test_a_run_imports_bitsandbytes_only_when_its_optimizer_is_bitsandbytes() -> None:
    """diffusers and peft import bitsandbytes whenever it is installed (about 0.7 s: it sets torch.compile up); a run
    not using its 8-bit AdamW has them take it as absent, and it stays importable for whoever asks for it later."""
    code = ("import sys; from ds_trainer.train.process import imports; imports.for_run({uses}); "
            "from diffusers.utils import is_bitsandbytes_available; import peft.tuners.lora; "
            "before = 'bitsandbytes' in sys.modules; import bitsandbytes.optim; "
            "print(before, is_bitsandbytes_available(), bitsandbytes.optim.AdamW8bit.__name__)")
    without = subprocess.run([sys.executable, "-c", code.format(uses=False)], capture_output=True, text=True)
    assert without.returncode == 0, without.stderr[-2000:]
    assert without.stdout.split() == ["False", "False", "AdamW8bit"]
    with_it = subprocess.run([sys.executable, "-c", code.format(uses=True)], capture_output=True, text=True)
    assert with_it.returncode == 0, with_it.stderr[-2000:]
    assert with_it.stdout.split() == ["True", "True", "AdamW8bit"]


def test_a_deepspeed_run_sets_torch_compile_up_for_muon_only_when_muon_runs() -> None:
    """Every ZeRO optimizer imports DeepSpeed's Muon module (to ask whether the optimizer is Muon), whose three
    `@torch.compile` functions import TorchInductor at that import: about 1 s of CPU in every DeepSpeed process. A run
    imports it with the torch.compile call deferred to the first call: Inductor is not loaded, and the first call
    compiles and computes what the function computes (Newton-Schulz: the singular values of the result near 1; the
    eager function's result within bf16's rounding, 3% measured)."""
    code = ("import sys, torch; from ds_trainer.train.process import imports; "
            "imports.for_run(False, deferred_muon=True); "
            "from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam; "
            "from deepspeed.runtime.zero.muon import original_muon as m; "
            "before = 'torch._inductor.compile_fx' in sys.modules; "
            "g = torch.randn(16, 8, generator=torch.Generator().manual_seed(0)); "
            "out = m.zeropower_via_newtonschulz5(g, steps=5).float(); "
            "eager = m.zeropower_via_newtonschulz5.__wrapped__(g, steps=5).float(); "
            "s = torch.linalg.svdvals(out); "
            "print(before, 'torch._inductor.compile_fx' in sys.modules, "
            "bool(((s > 0.5) & (s < 1.5)).all()), float((out - eager).norm() / eager.norm()) < 0.1)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines()[-1].split() == ["False", "True", "True", "True"]  # after DeepSpeed's line
