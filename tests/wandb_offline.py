"""Read a W&B offline run back without a server: the ``run-<id>.wandb`` file is a LevelDB-format log of wandb's own
protobuf ``Record`` messages (W&B's SDK no longer ships a Python reader; this is the documented LevelDB log format:
a 7-byte file header, then 32 KiB blocks of records, each ``crc32 uint32, length uint16, type uint8, data``)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    out, pos, chunk = [], HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # block trailer: padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0 and length == 0:  # zero padding to the end of the block
            pos += left
            continue
        chunk += data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(chunk)
            out.append(record)
            chunk = b""
    return out


def read_run(run_dir: Path) -> tuple[dict[int, dict], dict]:
    """(step -> logged metrics, config) of the single offline run under ``run_dir/wandb``."""
    files = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    history, config = {}, {}
    for r in records(files[0]):
        kind = r.WhichOneof("record_type")
        if kind == "history":
            row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
            history[int(row["_step"])] = {k: v for k, v in row.items() if not k.startswith("_")}
        updates = r.run.config.update if kind == "run" else r.config.update if kind == "config" else []
        for item in updates:
            config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return history, config
