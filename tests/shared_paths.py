"""Where the read-only shared evaluation data lies: ``../shared/data`` beside the checkout.

A throw-away clone (``git clone . $(mktemp -d)``) has no ``shared/`` beside it; then the data
beside the repository it was cloned from is used. ``NEMO_DAPO_SHARED_DATA`` overrides both.
"""

import os
import subprocess
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]


def _origin_checkout() -> Path | None:
    """The local repository this checkout was cloned from, if any."""
    url = subprocess.run(
        ["git", "-C", str(CHECKOUT), "config", "--get", "remote.origin.url"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return Path(url) if url and Path(url).is_dir() else None


def _shared_data() -> Path:
    if "NEMO_DAPO_SHARED_DATA" in os.environ:
        return Path(os.environ["NEMO_DAPO_SHARED_DATA"])
    beside = CHECKOUT.parent / "shared" / "data"
    origin = _origin_checkout()
    if beside.is_dir() or origin is None:
        return beside
    return origin.resolve().parent / "shared" / "data"


SHARED_DATA = _shared_data()
AIME_2024 = SHARED_DATA / "aime-2024.parquet"
AIME_2025 = SHARED_DATA / "aime25.parquet"
