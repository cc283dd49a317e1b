"""`make wheelhouse` (python -m ds_trainer.gpucheck.wheelhouse): the wheels a GPU machine without
network lacks.

The machine (docs/gpu-check.md) has Python 3.12, a CUDA torch, accelerate and the common libraries;
it lacks DeepSpeed, diffusers, Hydra and the rest below, and its transformers (5.17) and peft are
not the versions the tests vouch for, so those travel too (review 3's K4). This downloads them for
CPython 3.12 manylinux x86-64 at the versions constraints.txt pins, builds DeepSpeed's sdist into a
wheel here (DS_BUILD_OPS=0: its ops compile on the GPU machine, where nvcc is) and antlr4's (an
sdist only), keeps of bitsandbytes' 16 native libraries the two that machine loads (its CPU one and
the one for torch's CUDA, 13.0), and checks that every requirement of every wheel is met by a
version in the wheelhouse or on that machine. The carried sets and the checkout stay within the
device tool's 64 MiB (`TRANSFER_MIB`); install them there with
`pip install --no-index --no-deps --target DIR .wheelhouse/*/*.whl` and put DIR on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement

SETS = {
    # What `python -m ds_trainer` imports on its run path, with what those need that the machine
    # lacks, and what it has at another version than the tests'.
    "core": ["deepspeed", "hjson", "pydantic", "pydantic_core", "annotated-types",
             "typing-inspection", "typing_extensions", "diffusers", "importlib_metadata",
             "lazy-importer", "hydra-core", "omegaconf", "antlr4-python3-runtime", "prodigyopt",
             "schedulefree", "torch-optimi", "torchao", "submitit", "hydra-submitit-launcher",
             "peft", "transformers"],
    # optimizer=adamw8bit, quantize=nf4/int8; trimmed to the machine's CUDA (41 MiB whole)
    "bnb": ["bitsandbytes"],
    "wandb": ["wandb", "cwevals", "opentelemetry-api", "opentelemetry-sdk",  # logger=wandb only
              "opentelemetry-exporter-otlp-proto-http",
              "opentelemetry-exporter-otlp-proto-common", "opentelemetry-proto",
              "opentelemetry-semantic-conventions", "googleapis-common-protos",
              "opentelemetry-exporter-http-transport", "opentelemetry-exporter-otlp-common",
              "distro", "sniffio", "platformdirs"],
}
BUILT_HERE = {"deepspeed", "antlr4-python3-runtime"}  # sdists: built into wheels on this machine
# On the GPU machine already (KINDS.md's package list): what the check need not bring.
PRESENT = {"torch", "numpy", "packaging", "psutil", "py-cpuinfo", "msgpack", "ninja", "tqdm",
           "einops", "nvidia-ml-py", "pyyaml", "filelock", "huggingface-hub", "regex", "requests",
           "safetensors", "pillow", "httpx", "cloudpickle", "zipp", "accelerate", "matplotlib",
           "xxhash", "protobuf", "typer", "click", "setuptools", "jinja2", "fsspec", "tokenizers",
           "sympy", "networkx", "typing-extensions", "urllib3", "certifi", "idna",
           "charset-normalizer", "triton", "anyio", "h11"}
# Their versions where KINDS.md's pip list gives them (nvidia-h100-x1 and nvidia-h200 share the
# image): a requirement of a carried wheel is checked against these.
MACHINE_VERSIONS = {"torch": "2.11.0", "accelerate": "1.15.0", "huggingface-hub": "1.33.0",
                    "numpy": "2.5.2", "safetensors": "0.8.0", "tokenizers": "0.23.2",
                    "triton": "3.6.0"}
MACHINE_CUDA = "130"  # torch 2.11.0+cu130: bitsandbytes loads libbitsandbytes_cuda130.so
TRANSFER_MIB = 64  # the device tool's working tree, carried paths included
LIMIT_MIB = 60  # the carried sets together: the rest is the checkout (about 3.8 MiB)
PLATFORMS = ["manylinux2014_x86_64"] + [f"manylinux_2_{n}_x86_64"
                                        for n in (17, 24, 27, 28, 31, 34, 35, 39)]


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
        subprocess.run([*pip, "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--implementation", "cp", *platform, "-d",
                        str(folder), *_pinned(binary, versions)], check=True)
    if built:  # pure Python once the ops are left out: a py3 wheel installs on 3.12
        subprocess.run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                        str(folder), *_pinned(built, versions)], check=True,
                       env={**os.environ, "DS_BUILD_OPS": "0"})


def trim_native(wheel: Path, keep: tuple[str, ...]) -> int:
    """Drop the native libraries of `wheel` that the GPU machine never loads (bitsandbytes ships one
    per CUDA and ROCm release, 16 in 41 MiB; its loader picks the one for torch's CUDA) and their
    RECORD lines; the bytes saved."""
    before = wheel.stat().st_size
    tmp = wheel.with_suffix(".tmp")

    def dropped(name: str) -> bool:
        native = name.endswith(".so") and "/libbitsandbytes_" in f"/{name}"
        return native and not name.endswith(keep)

    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for item in src.infolist():
            if dropped(item.filename):
                continue
            data = src.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(ln for ln in lines if not dropped(ln.split(",", 1)[0])).encode()
            dst.writestr(item, data)
    os.replace(tmp, wheel)
    return before - wheel.stat().st_size


def requirements(wheel: Path) -> list[Requirement]:
    """The wheel's requirements that apply on CPython 3.12 on Linux without extras."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64",
           "implementation_name": "cpython", "extra": ""}
    out = []
    for line in lines:
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or req.marker.evaluate(env):
                out.append(req)
    return out


def dist_name(wheel: Path) -> str:
    return norm(wheel.name.split("-")[0])


def _unmet(wheel: Path, req: Requirement, versions: dict[str, str]) -> str | None:
    """Why `req` of `wheel` is not met on the machine with the wheelhouse installed, or None."""
    name = norm(req.name)
    if name not in versions and name in PRESENT:
        return None
    if name not in versions:
        return (f"{wheel.name} needs {name}, which is neither in the wheelhouse nor on the GPU "
                "machine")
    if req.specifier.contains(versions[name], prereleases=True):
        return None
    return f"{wheel.name} needs {req}, and the GPU machine would have {name} {versions[name]}"


def check(root: Path, carried: tuple[str, ...] = ("core", "bnb")) -> list[str]:
    """Requirements that neither the wheelhouse nor the machine meet (by version where the machine's
    is known), and the carried sets over the limit together."""
    wheels = list(root.glob("*/*.whl"))
    versions = {**MACHINE_VERSIONS, **{dist_name(w): w.name.split("-")[1] for w in wheels}}
    problems = [why for w in wheels for r in requirements(w) if (why := _unmet(w, r, versions))]
    size = sum(w.stat().st_size for name in carried for w in (root / name).glob("*.whl")) / 2**20
    if size > LIMIT_MIB:
        problems.append(f"{' + '.join(carried)}: {size:.1f} MiB, over {LIMIT_MIB} MiB (the device "
                        f"tool carries {TRANSFER_MIB} MiB with the checkout)")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ds_trainer.gpucheck.wheelhouse",
                                     description=__doc__)
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
        for wheel in folder.glob("bitsandbytes-*.whl"):
            saved = trim_native(wheel, ("_cpu.so", f"_cuda{MACHINE_CUDA}.so"))
            print(f"{wheel.name}: {saved / 2**20:.1f} MiB of other CUDA and ROCm releases dropped")
        size = sum(w.stat().st_size for w in folder.glob("*.whl")) / 2**20
        print(f"{folder}: {len(list(folder.glob('*.whl')))} wheels, {size:.1f} MiB", flush=True)
    problems = check(args.out)
    for problem in problems:
        print(f"wheelhouse: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
