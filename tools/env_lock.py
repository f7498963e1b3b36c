"""The locked CPU environment: ``tools/cpu-lock.txt`` holds every installed distribution at the
version the tests passed with, and ``tools/bootstrap.sh`` installs exactly those.

    python tools/env_lock.py check    # the running environment equals the lock (CI runs this as a test)
    python tools/env_lock.py write    # record the running environment (after `make lock` resolved it)
    python tools/env_lock.py unlocked # installed packages the lock does not hold (bootstrap removes them)
"""

from __future__ import annotations

import sys
import sysconfig
from importlib import metadata
from pathlib import Path

from packaging.utils import canonicalize_name

LOCK = Path(__file__).resolve().with_name("cpu-lock.txt")
# the project itself (installed editable from the checkout) and the installer's own tools
NOT_LOCKED = {"nemo-dapo", "pip", "setuptools", "wheel"}
HEADER = (
    "# The CPU environment the tests passed with (Python 3.11, x86-64 Linux): tools/bootstrap.sh installs\n"
    "# exactly these with --no-deps. Update: `make lock` (resolves afresh from pyproject.toml, then rewrites this).\n"
)


def installed() -> dict[str, str]:
    """name -> version of every distribution installed in this environment's site-packages (not
    what a running library put on ``sys.path``: Ray adds its vendored packages there)."""
    folders = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    found = {canonicalize_name(d.metadata["Name"]): d.version for d in metadata.distributions(path=folders)}
    return {name: version for name, version in sorted(found.items()) if name not in NOT_LOCKED}


def read_lock(path: Path = LOCK) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = version.strip()
    return pins


def differences(lock: dict[str, str], env: dict[str, str]) -> list[str]:
    """What differs between the lock and the environment, one line per package."""
    problems = [f"{n}: locked {v}, installed {env.get(n, 'nothing')}" for n, v in lock.items() if env.get(n) != v]
    problems += [f"{n}: installed {v}, not in the lock" for n, v in env.items() if n not in lock]
    return problems


def main(argv: list[str]) -> int:
    if argv == ["write"]:
        LOCK.write_text(HEADER + "".join(f"{name}=={version}\n" for name, version in installed().items()))
        print(f"wrote {LOCK} ({len(installed())} packages)")
        return 0
    if argv == ["unlocked"]:
        print(" ".join(name for name in installed() if name not in read_lock()))
        return 0
    if argv == ["check"]:
        problems = differences(read_lock(), installed())
        print("\n".join(problems) or f"the environment equals {LOCK.name}")
        return 1 if problems else 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
