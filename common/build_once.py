"""A model directory built once per machine, whoever asks for it first."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


def build_once(path: str | Path, build: Callable[[], object], force: bool = False) -> bool:
    """Build the model directory ``path`` with ``build()`` unless it has a config.json (``force``: build anyway).
    Under a lock (a file in the temp dir named by the path's hash): a second process that wants the same model
    meanwhile (two jobs, or the suite's two lanes, on one machine) waits for the first build and then uses its
    result, instead of building it again and renaming its copy over a directory the first one's engines may be
    loading. True when this call built it."""
    import hashlib
    import tempfile

    from filelock import FileLock

    path = Path(path)
    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    with FileLock(Path(tempfile.gettempdir()) / f"fleetrl-build-{key}.lock"):
        if (path / "config.json").exists() and not force:
            return False
        build()
        return True
