"""Where the read-only shared evaluation data lies: ``../shared/data`` beside the checkout."""

import os
from pathlib import Path

SHARED_DATA = Path(os.environ.get("NEMO_DAPO_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
AIME_2024 = SHARED_DATA / "aime-2024.parquet"
AIME_2025 = SHARED_DATA / "aime25.parquet"
