"""The config reference table, generated from the pydantic models of :mod:`orchestrator.config` (the README
embeds it; `fleetrl config docs` prints it; tests/test_docs.py keeps the README copy in sync)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from orchestrator.config import ALGORITHM_SECTIONS, FleetConfig


def _type_name(ann) -> str:
    import typing

    if typing.get_origin(ann) is Literal:
        return " / ".join(f"`{a}`" for a in typing.get_args(ann))
    return getattr(ann, "__name__", None) or str(ann).replace("typing.", "")


def config_reference_markdown() -> str:
    """The config reference as a Markdown table, generated from the models (the README embeds it)."""
    rows = ["| key | type | default | description |", "|---|---|---|---|"]

    def walk(cls: type[BaseModel], prefix: str) -> None:
        for name, field in cls.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                walk(ann, f"{prefix}{name}.")
                continue
            default = field.get_default(call_default_factory=True)
            if isinstance(default, list):
                default = [d.model_dump() if isinstance(d, BaseModel) else d for d in default]
            typ = _type_name(ann)
            desc = " ".join((field.description or "").split()).replace("|", "\\|")
            rows.append(f"| `{prefix}{name}` | {typ.replace('|', 'or')} | `{default!r}` | {desc} |")

    for section, field in FleetConfig.model_fields.items():
        if section == "algorithm":
            for member in ALGORITHM_SECTIONS:
                rows.append(f"| **`algorithm` (name: `{member.model_fields['name'].default}`)** | | | "
                            f"{' '.join((member.__doc__ or '').split())} |")
                walk(member, "algorithm.")
        elif isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            walk(field.annotation, f"{section}.")
    return "\n".join(rows) + "\n"
