"""The docs say only what exists: the config reference is generated from the pydantic models, and every `fleetrl`
command, `make` target, config key and relative link named in README.md and docs/ is real. The README stays a
landing page (at most 12 KB)."""

import json
import re
from pathlib import Path

import pytest

from orchestrator.config.docs import config_reference_markdown

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "configuration.md"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PATTERN = re.compile(r"(<!-- config-reference:start -->\n)(.*?)(<!-- config-reference:end -->)", re.S)
SECTIONS = "model|data|rollout|reward|algorithm|learner|trainer|run|rft|sft|distill|env|prm|search"
FILES = (".py", ".md", ".gguf", ".yaml", ".json", ".jsonl", ".png", ".db")


def render(text: str) -> str:
    return PATTERN.sub(lambda m: m.group(1) + config_reference_markdown() + m.group(3), text)


def code_text(page: Path) -> str:
    """The page's fenced code blocks and inline code spans (where commands and keys are written)."""
    text = PATTERN.sub("", page.read_text())
    blocks = re.findall(r"```.*?\n(.*?)```", text, re.S)
    spans = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    return "\n".join(blocks + spans)


def test_config_reference_is_current():
    text = REFERENCE.read_text()
    assert PATTERN.search(text), "docs/configuration.md lacks the config-reference markers"
    assert render(text) == text, "docs/configuration.md config reference is stale: run `make docs`"


def test_every_field_is_documented():
    rows = [line for line in config_reference_markdown().splitlines() if line.startswith("| `")]
    undocumented = sorted({row.split("|")[1].strip() for row in rows if not row.split("|")[4].strip()})
    assert len(rows) > 150 and not undocumented, undocumented


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_commands_and_make_targets_exist(page):
    from orchestrator.cli.main import _parser

    sub = next(a for a in _parser()._actions if a.dest == "command")
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z0-9][a-z0-9-]*):", makefile, re.M))
    code = code_text(page)
    commands = set(re.findall(r"(?:^|\$ |&& )fleetrl ([a-z][a-z-]*)", code, re.M))
    makes = set(re.findall(r"(?:^|\$ |&& )make ([a-z0-9][a-z0-9-]*)", code, re.M))
    assert commands <= set(sub.choices), f"{page.name}: unknown commands {commands - set(sub.choices)}"
    assert makes <= targets, f"{page.name}: unknown make targets {makes - targets}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_config_keys_exist(page):
    known = set(re.findall(r"^\| `([a-z_.]+)`", config_reference_markdown(), re.M))
    keys = set(re.findall(rf"(?<![\w./-])((?:{SECTIONS})\.[a-z_]+(?:\.[a-z_]+)*)(?=[\s=`:,)\]]|$)", code_text(page)))
    prefixes = {k.rsplit(".", 1)[0] for k in known}  # a section itself, e.g. `reward.model`
    unknown = sorted(k for k in keys if k not in known and k not in prefixes and not k.endswith(FILES))
    assert not unknown, f"{page.name}: config keys that do not exist: {unknown}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text())
    missing = [link for link in links if "://" not in link and not (page.parent / link).exists()]
    assert not missing, f"{page.name}: broken links {missing}"


def bash_commands(page: Path) -> list[str]:
    """The `fleetrl ...` command lines of the page's ```bash blocks: continuation lines joined, the comment and a
    trailing `&` dropped, `<placeholder>` made one word."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            found = re.search(r"(?:^|\$ |&& )(fleetrl [^#]*)", line.strip())
            if found:
                lines.append(re.sub(r"<[^>]*>", "PLACEHOLDER", found.group(1)).strip().rstrip("&").strip())
    return lines


def _needs_a_missing_file(argv: list[str]) -> bool:
    """A command of the docs names a file, directory or plugin module that is not in the checkout (a run's output,
    the reader's own data, config or module): it is parsed, not loaded."""
    import importlib.util

    for i, word in enumerate(argv):
        key, _, value = word.rpartition("=") if "=" in word and not word.startswith("-") else ("", "", word)
        if value == "PLACEHOLDER":
            return True
        if key.endswith(".dir") or value.startswith("-"):
            continue
        module = re.search(r"([A-Za-z_][\w.]*):[A-Za-z_]\w*", value)
        if module and "://" not in value and importlib.util.find_spec(module.group(1).split(".")[0]) is None:
            return True
        if (argv[i - 1] in ("-c", "--config") or "/" in value) and not (ROOT / value).exists():
            return True
    return False


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_yaml_blocks_load_and_commands_parse(page):
    """Every ```yaml block loads; every `fleetrl` command line parses; a `train` or `config show` line whose files
    exist passes `config show` (its config loaded and every check a run makes at load; a config that names a run's
    output, as `distill.teacher: runs/.../final`, may fail only on that path)."""
    import shlex

    import yaml

    from orchestrator.cli.main import parse_args, show_config

    for block in re.findall(r"```yaml\n(.*?)```", page.read_text(), re.S):
        try:
            yaml.safe_load(block)
        except yaml.YAMLError as e:
            pytest.fail(f"{page.name}: a yaml block does not load: {e}\n{block}")
    for line in bash_commands(page):
        try:
            args = parse_args(shlex.split(line)[1:])
        except SystemExit:
            pytest.fail(f"{page.name}: `{line}` does not parse")
        if args.command in ("train", "config") and not _needs_a_missing_file(shlex.split(line)):
            try:
                show_config(args.config, args.overrides, args.stage)
            except Exception as e:  # unless its config names a file that is not here (a run's output)
                missing = [p for p in re.findall(r"'([^']+/[^']+)'", str(e)) if not (ROOT / p).exists()]
                if not missing:
                    pytest.fail(f"{page.name}: `{line}` fails `config show`: {e}")


def test_readme_is_a_landing_page():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= 12 * 1024, f"README.md is {size} bytes; reference material belongs in docs/"


if __name__ == "__main__":
    REFERENCE.write_text(render(REFERENCE.read_text()))


def test_benchmark_tables_are_generated_from_their_results(tmp_path):
    """docs/BENCHMARKS.md's generated tables equal what bench/results renders, and a stale one is caught."""
    from bench.tables import DOCS
    from bench.tables import render as render_tables

    doc = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    assert "<!-- bench:end_to_end -->" in doc
    assert render_tables(doc, ROOT / "bench" / "results") == doc, "run `python -m bench.tables`"
    readme = (ROOT / "README.md").read_text()
    assert "<!-- bench:readme_end_to_end -->" in readme
    for page in DOCS:
        text = (ROOT / page).read_text()
        assert render_tables(text, ROOT / "bench" / "results") == text, f"{page}: run `python -m bench.tables`"
    result = {"meta": {"cpu": "Test CPU (AVX2)", "commit": "abc", "time": "t", "cpus": 2},
              "gen_heavy": {"runs": [{"system": "fleetrl (sync, fp32)", "step_s": 10.0, "completions_per_s": 6.4,
                                      "mean_len": 128}, {"system": "TRL GRPOTrainer (fp32)", "step_s": 20.0,
                                                         "completions_per_s": 3.2, "mean_len": 128}]}}
    (tmp_path / "end_to_end.json").write_text(json.dumps(result))
    stale = "<!-- bench:end_to_end -->\n| old | table |\n<!-- /bench -->"
    fresh = render_tables(stale, tmp_path)
    assert fresh != stale and "Test CPU (AVX2)" in fresh and "commit `abc`" in fresh and "| 2 |" in fresh
    assert render_tables(fresh, tmp_path) == fresh


def test_every_result_a_generated_table_reads_is_committed():
    """bench/results/ is git-ignored, so a new result must be added with `git add -f`; a clean clone (CI) would
    render "No result yet" (CI once failed so)."""
    import re
    import subprocess

    from bench.tables import DOCS, TABLES

    tracked = set(subprocess.run(["git", "ls-files", "bench/results"], cwd=ROOT, capture_output=True, text=True,
                                 check=True).stdout.split())
    if not tracked:  # not a git checkout (an installed copy): nothing to compare
        return
    for doc in DOCS:
        for name in set(re.findall(r"<!-- bench:(\w+) -->", (ROOT / doc).read_text())) & set(TABLES):
            assert f"bench/results/{TABLES[name][0]}" in tracked, f"git add -f bench/results/{TABLES[name][0]}"
