"""docs/configuration.md's config reference is generated from the pydantic models, not hand-maintained."""

import re
from pathlib import Path

from orchestrator.config_docs import config_reference_markdown

README = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
PATTERN = re.compile(r"(<!-- config-reference:start -->\n)(.*?)(<!-- config-reference:end -->)", re.S)


def render(text: str) -> str:
    return PATTERN.sub(lambda m: m.group(1) + config_reference_markdown() + m.group(3), text)


def test_readme_config_reference_is_current():
    text = README.read_text()
    assert PATTERN.search(text), "docs/configuration.md lacks the config-reference markers"
    assert render(text) == text, "docs/configuration.md config reference is stale: run `make docs`"


if __name__ == "__main__":
    README.write_text(render(README.read_text()))
