"""`make wheelhouse` (python -m ds_trainer.gpucheck.wheelhouse): the wheels a GPU machine without network lacks.

The machine (docs/gpu-check.md) has Python 3.12, a CUDA torch, accelerate, transformers, peft and the common
libraries; it lacks DeepSpeed, diffusers, Hydra and the rest below. This downloads them for CPython 3.12 manylinux
x86-64 at the versions constraints.txt pins, builds DeepSpeed's sdist into a wheel here (DS_BUILD_OPS=0: its ops
compile on the GPU machine, where nvcc is) and antlr4's (an sdist only), and checks that every requirement of every
wheel is either in the wheelhouse or on that machine. Each set stays under 60 MiB, so that one set and the
checkout travel together within a 64 MiB transfer; install one there with
`pip install --no-index --no-deps --target DIR .wheelhouse/core/*.whl` and put DIR on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

SETS = {
    # What `python -m ds_trainer` imports on its run path, with what those need that the machine lacks.
    "core": ["deepspeed", "hjson", "pydantic", "pydantic_core", "annotated-types", "typing-inspection",
             "typing_extensions", "diffusers", "importlib_metadata", "lazy-importer", "hydra-core", "omegaconf",
             "antlr4-python3-runtime", "prodigyopt", "schedulefree", "torch-optimi", "torchao", "submitit",
             "hydra-submitit-launcher"],
    "bnb": ["bitsandbytes"],  # optimizer=adamw8bit; 43 MB alone
    "wandb": ["wandb", "cwevals", "opentelemetry-api", "opentelemetry-sdk",  # logger=wandb only
              "opentelemetry-exporter-otlp-proto-http",
              "opentelemetry-exporter-otlp-proto-common", "opentelemetry-proto",
              "opentelemetry-semantic-conventions", "googleapis-common-protos",
              "opentelemetry-exporter-http-transport", "opentelemetry-exporter-otlp-common", "distro", "sniffio"],
}
BUILT_HERE = {"deepspeed", "antlr4-python3-runtime"}  # sdists: built into wheels on this machine
# On the GPU machine already (its image's package list, docs/gpu-check.md): what the check need not bring.
PRESENT = {"torch", "numpy", "packaging", "psutil", "py-cpuinfo", "msgpack", "ninja", "tqdm", "einops",
           "nvidia-ml-py", "pyyaml", "filelock", "huggingface-hub", "regex", "requests", "safetensors", "pillow",
           "httpx", "cloudpickle", "zipp", "accelerate", "transformers", "peft", "matplotlib", "xxhash", "protobuf",
           "click", "platformdirs", "setuptools", "jinja2", "fsspec", "tokenizers", "sympy", "networkx",
           "typing-extensions", "urllib3", "certifi", "idna", "charset-normalizer", "triton", "anyio", "h11"}
LIMIT_MIB = 60
PLATFORMS = ["manylinux2014_x86_64"] + [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35, 39)]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(constraints: Path) -> dict[str, str]:
    """{normalized name: version} of constraints.txt."""
    out = {}
    for line in constraints.read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==", 1)
            out[norm(name)] = version.strip()
    return out


def _pinned(names: list[str], versions: dict[str, str]) -> list[str]:
    missing = [n for n in names if norm(n) not in versions]
    if missing:
        raise SystemExit(f"wheelhouse: constraints.txt pins no version of {', '.join(missing)}")
    return [f"{n}=={versions[norm(n)]}" for n in names]


def fetch(folder: Path, names: list[str], versions: dict[str, str]) -> None:
    """Download the binary wheels and build the sdists of `names` into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    binary = [n for n in names if norm(n) not in BUILT_HERE]
    built = [n for n in names if norm(n) in BUILT_HERE]
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    if binary:
        platform = [arg for p in PLATFORMS for arg in ("--platform", p)]
        subprocess.run([*pip, "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
                        "--implementation", "cp", *platform, "-d", str(folder), *_pinned(binary, versions)],
                       check=True)
    if built:  # pure Python once the ops are left out: a py3 wheel installs on 3.12
        subprocess.run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(folder),
                        *_pinned(built, versions)], check=True, env={**os.environ, "DS_BUILD_OPS": "0"})


def requirements(wheel: Path) -> list[str]:
    """The wheel's requirements that apply on CPython 3.12 on Linux without extras."""
    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython", "extra": ""}
    out = []
    for line in lines:
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or req.marker.evaluate(env):
                out.append(norm(req.name))
    return out


def dist_name(wheel: Path) -> str:
    return norm(wheel.name.split("-")[0])


def check(root: Path) -> list[str]:
    """Requirements that neither the wheelhouse nor the machine provide, and sets over the limit."""
    wheels = list(root.glob("*/*.whl"))
    have = {dist_name(w) for w in wheels} | PRESENT
    problems = [f"{w.name} needs {r}, which is neither in {root} nor on the GPU machine"
                for w in wheels for r in requirements(w) if r not in have]
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        size = sum(w.stat().st_size for w in folder.glob("*.whl")) / 2**20
        if size > LIMIT_MIB:
            problems.append(f"{folder.name}: {size:.1f} MiB, over {LIMIT_MIB} MiB")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ds_trainer.gpucheck.wheelhouse", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path(".wheelhouse"))
    parser.add_argument("--constraints", type=Path, default=Path("constraints.txt"))
    parser.add_argument("--sets", nargs="+", default=list(SETS), choices=list(SETS))
    args = parser.parse_args(argv)
    versions = pins(args.constraints)
    for name in args.sets:
        folder = args.out / name
        for old in folder.glob("*.whl"):
            old.unlink()
        fetch(folder, SETS[name], versions)
        size = sum(w.stat().st_size for w in folder.glob("*.whl")) / 2**20
        print(f"{folder}: {len(list(folder.glob('*.whl')))} wheels, {size:.1f} MiB", flush=True)
    problems = check(args.out)
    for problem in problems:
        print(f"wheelhouse: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
