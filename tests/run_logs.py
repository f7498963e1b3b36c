"""Read back what the W&B (offline) and MLflow sinks wrote, without their servers."""

import json
import struct
from pathlib import Path


def wandb_records(run_file: Path):
    """The protobuf ``Record`` messages of an offline ``run-*.wandb`` file: a LevelDB-style log
    (7-byte file header, 32 KiB blocks of records with 7-byte headers: crc, length,
    FULL/FIRST/MIDDLE/LAST)."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, pending = run_file.read_bytes(), 32768, 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        room = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7]) if room >= 7 else (0, 0, 0)
        if room < 7 or (length == 0 and kind == 0):  # block trailer / padding
            pos += room
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: one whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _items(items) -> dict:
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}


def wandb_history(run_file: Path) -> dict[int, dict]:
    """The history rows of an offline W&B run file, by step."""
    rows = (_items(r.history.item) for r in wandb_records(run_file) if r.WhichOneof("record_type") == "history")
    return {row["_step"]: row for row in rows}


def wandb_config(run_file: Path) -> dict:
    """The run's config: what ``wandb.init`` got (the run record), then later updates."""
    config: dict = {}
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind in ("run", "config"):
            config.update(_items((record.run.config if kind == "run" else record.config).update))
    return config


def mlflow_history(output: Path, run_id: str, name: str) -> dict[int, float]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{output / 'mlflow.db'}")
    return {m.step: m.value for m in client.get_metric_history(run_id, name)}
