"""A Hugging Face Hub cache written by hand (``HF_HOME/hub/<type>s--org--name/{refs/main, snapshots/<commit>/,
blobs/}``), as `huggingface-cli download` leaves it: what the Hub-id tests resolve offline."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def add_repo(hf_home: Path, repo_id: str, files: dict[str, bytes], repo_type: str = "model",
             commit: str | None = None) -> Path:
    """``files`` (path in the repo -> content) cached as ``repo_id`` at ``refs/main``; the snapshot directory."""
    org, name = repo_id.split("/")
    repo = Path(hf_home) / "hub" / f"{repo_type}s--{org}--{name}"
    commit = commit or hashlib.sha1(repo_id.encode()).hexdigest()
    snap = repo / "snapshots" / commit
    for rel, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snap / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.exists() or link.is_symlink():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snap


def add_model_dir(hf_home: Path, repo_id: str, model_dir: Path) -> Path:
    """A local model directory cached as the Hub model ``repo_id``."""
    files = {str(p.relative_to(model_dir)): p.read_bytes() for p in Path(model_dir).rglob("*") if p.is_file()}
    return add_repo(hf_home, repo_id, files)


def parquet_bytes(rows: list[dict]) -> bytes:
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    return buf.getvalue()


def add_dataset(hf_home: Path, repo_id: str, config: str, splits: dict[str, list[dict]]) -> Path:
    """A dataset repo in the Hub layout: a README whose YAML header declares ``config`` with one parquet file
    per split (``<config>/<split>-00000-of-00001.parquet``), as GSM8K's repo is laid out."""
    data_files = "".join(f"  - split: {s}\n    path: {config}/{s}-*\n" for s in splits)
    readme = f"---\nconfigs:\n- config_name: {config}\n  data_files:\n{data_files}---\n# {repo_id}\n"
    files = {"README.md": readme.encode()}
    files.update({f"{config}/{s}-00000-of-00001.parquet": parquet_bytes(rows) for s, rows in splits.items()})
    return add_repo(hf_home, repo_id, files, repo_type="dataset")


def gsm8k_rows(n: int, start: int = 0) -> list[dict]:
    """GSM8K-shaped rows: ``question`` and ``answer`` ending in ``#### N``."""
    return [{"question": f"What is {a} plus {a + 1}?", "answer": f"{a} + {a + 1} = {2 * a + 1}\n#### {2 * a + 1}"}
            for a in range(start, start + n)]

