"""The base of every config section (kept apart so the algorithm sections can live in their own module)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, model_validator


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, docstrings become field descriptions, and a boolean
    is not a number (pydantic would read ``group_size: true`` as 1)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)

    @model_validator(mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, data):
        for key, value in data.items() if isinstance(data, dict) else ():
            field = cls.model_fields.get(key)
            annotation = str(field.annotation) if field is not None else ""
            if isinstance(value, bool) and ("int" in annotation or "float" in annotation) and "bool" not in annotation:
                raise ValueError(f"{key}: a number is expected, not the boolean {str(value).lower()}")
        return data
