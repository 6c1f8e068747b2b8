"""Hugging Face Hub references: a model or dataset named ``org/name`` resolved to a local snapshot directory.

A key that takes a model or a dataset (``model.path``, ``data.path``, ...) takes a local path or a Hub id. A Hub
id is resolved once, at load, with ``huggingface_hub.snapshot_download`` (which honours ``HF_HOME``,
``HF_HUB_OFFLINE`` and ``HF_TOKEN``): offline, the cached snapshot of the revision is used; online, it is
downloaded first. The key is then rewritten to the snapshot directory, so everything downstream sees a local
path, and the id with the commit it resolved to is recorded (``org/name@commit``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_]$")


class HubError(ValueError):
    """A Hub reference that cannot be resolved; the message names the key, the id and what to do."""


@dataclass(frozen=True)
class Resolved:
    """A local directory for a reference: ``source`` is ``org/name@commit`` when it came from the Hub, else None."""

    path: str
    source: str | None = None


def is_hub_id(ref: str) -> bool:
    """Whether ``ref`` names a Hub repo (``org/name``) rather than a local path: the form matches and no such path
    exists here (a local directory ``org/name`` wins)."""
    return bool(_REPO_ID.match(ref)) and ".." not in ref and not Path(ref).exists()


def resolve(ref: str, key: str, revision: str | None = None, repo_type: str = "model") -> Resolved:
    """``ref`` as a local directory: a local path unchanged, a Hub id through the Hub cache (see the module doc);
    a HubError naming ``key`` when the id cannot be had."""
    if not is_hub_id(ref):
        return Resolved(ref)
    from huggingface_hub import snapshot_download

    try:
        path = snapshot_download(ref, revision=revision, repo_type=repo_type, cache_dir=_hub_cache(),
                                 local_files_only=_offline())
    except Exception as e:  # noqa: BLE001 - translated below; anything else is re-raised
        raise _explain(e, ref, key, revision, repo_type) from None
    return Resolved(path, f"{ref}@{Path(path).name}")


def _explain(e: Exception, ref: str, key: str, revision: str | None, repo_type: str) -> Exception:
    """One line for the user: which id, which key and the variable or value to change."""
    from huggingface_hub import errors

    what = f"{key}: Hub {repo_type} {ref!r}" + (f" (revision {revision!r})" if revision else "")
    if isinstance(e, errors.GatedRepoError):  # before RepositoryNotFoundError: it is a subclass
        return HubError(f"{what} is gated: accept its terms on the Hub and set HF_TOKEN to a token that may read it")
    if isinstance(e, errors.RevisionNotFoundError):
        return HubError(f"{what}: no such revision; give an existing branch, tag or commit")
    if isinstance(e, errors.RepositoryNotFoundError):
        return HubError(f"{what} does not exist or is private (set HF_TOKEN for a private repo; a local path must "
                        "exist)")
    if isinstance(e, errors.LocalEntryNotFoundError | errors.OfflineModeIsEnabled | FileNotFoundError):
        return HubError(f"{what} is not in the Hub cache ({_hub_cache()}), HF_HUB_OFFLINE is set or the Hub "
                        f"cannot be reached, and there is no local directory {ref!r}: download it once online (unset "
                        "HF_HUB_OFFLINE), or set HF_HOME to the cache that holds it")
    if isinstance(e, errors.HfHubHTTPError | OSError):
        return HubError(f"{what}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    return e


def _hub_cache() -> str:
    """The Hub cache this process's environment names now (huggingface_hub reads it once, at its import)."""
    env = os.environ
    if env.get("HF_HUB_CACHE"):
        return env["HF_HUB_CACHE"]
    if env.get("HF_HOME"):
        return os.path.join(os.path.expanduser(env["HF_HOME"]), "hub")
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def _offline() -> bool:
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE")
    return constants.HF_HUB_OFFLINE if value is None else value.upper() in ("1", "ON", "YES", "TRUE")
