"""`fleetrl pipeline -c RECIPE [overrides]`: multi-stage training (DeepSeek-R1: cold-start SFT -> reasoning RL ->
rejection sampling + SFT -> RL for all tasks) as one resumable run.

A recipe is YAML::

    base: default.yaml            # a config file (relative to the recipe) or a mapping of config sections
    stages:
      - name: cold_start
        kind: sft                 # sft | rl | rft | distill | dpo
        cold_start: 2000          # sft only: write this many verified rows of the task first (fleetrl data);
                                  # or tool_demos: N, tool demonstrations for env.tools (fleetrl data tool-demos)
        overrides: {trainer.total_steps: 60}

Each stage is ``base`` + its ``overrides`` + the command line's overrides (applied to every stage, so
``trainer.total_steps=2`` shrinks a whole recipe), runs in ``<run.dir>/<NN>-<name>/`` and starts from the previous
stage's ``final/`` model (the first from ``model.path``) and draws its own training prompts (stage i's
``data.seed`` is the base's plus i - 1 unless the stage sets it; the held-out set never changes). Every stage's
config, data files and teacher are checked before the first stage starts. ``<run.dir>/summary.json`` records
each stage (name, kind, status, held-out accuracy after it, seconds, model path, attempts, the checkpoint it
resumed from); rerunning the same command skips finished
stages and resumes an interrupted one from its newest complete checkpoint.

The stages run in this process, one after another on one fleet (:meth:`orchestrator.rl.fleet.Fleet.serve`): the
learner ranks load each stage's starting model, loss and optimizer in place, the engines get its weights, and the
reward actors stay, instead of a start-up per stage; a stage whose settings change a group's actors (ranks,
engine settings, reward functions) gets new ones for that group. The data a stage writes first with
Constitutional AI (``cai_revisions``, ``ai_preferences``) comes from the same fleet (``fleetrl cai``'s code).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import ValidationError

from orchestrator.config import (
    ConfigError,
    FleetConfig,
    _format_validation_error,
    apply_override,
    dump_config,
    load_config,
)
from orchestrator.rl import checkpoint as ckpt
from rewards.datasets import DatasetError, read_yaml_mapping

COMMANDS = {"sft": "sft", "rl": "train", "rft": "rft", "distill": "distill", "dpo": "train", "reward_model": "train"}
"""Stage kind -> the `fleetrl` command that runs it."""
RECIPE_KEYS = {"base", "stages", "description", "guard"}
GUARD_ACTIONS = ("warn", "rollback", "stop")
DEFAULT_GUARD = {"action": "warn", "margin": 0.02}
"""The stage guard (recipe key ``guard``): a stage whose held-out accuracy at its end is below its accuracy at its
start (its first eval, of the policy it was handed) by more than ``margin`` is reported (``warn``), or the policy
it was handed goes on to the next stage instead (``rollback``), or the pipeline stops (``stop``)."""
DATA_KEYS = {"cold_start": ("sft",), "tool_demos": ("sft",), "cai_revisions": ("sft",),
             "ai_preferences": ("dpo", "reward_model")}
"""Stage keys that make a stage write its own data first (``N`` rows: ``fleetrl data cold-start|tool-demos``,
``fleetrl cai revise|prefer``), and the stage kinds each is for."""
PAIR_KINDS = ("dpo", "reward_model")
"""Stage kinds whose algorithm section is replaced by their own (``algorithm.name`` = the kind), reading pairs."""
STAGE_KEYS = {"name", "kind", "overrides", "pass", *DATA_KEYS}


@dataclass
class Stage:
    index: int
    name: str
    kind: str
    cfg: FleetConfig
    writes: tuple[str, int] | None = None  # (a DATA_KEYS entry, rows): data this sft stage writes first
    hands: str = "final"  # what the next stage trains from: final/, or best/ (the stage's `pass: best`)

    @property
    def dir(self) -> Path:
        return Path(self.cfg.run.dir)


def _overrides(value, where: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, dict):
        return [f"{k}={yaml.safe_dump(v, default_flow_style=True).strip().removesuffix('...').strip()}"
                for k, v in value.items()]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise ConfigError(f"{where}: overrides must be a mapping of dotted keys to values, or a list of 'key=value'")


def _read_yaml(path: Path, what: str) -> dict:
    return read_yaml_mapping(path, what, ConfigError)


def is_recipe(path: str) -> bool:
    """Whether a YAML file is a multi-stage recipe (has ``stages``) rather than a run config."""
    try:
        tree = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return False  # load_config reports it
    return isinstance(tree, dict) and "stages" in tree


def config_or_stage(path: str | None, overrides: list[str], writes: str | None = None) -> FleetConfig:
    """A config file's settings; for a pipeline recipe (a file with ``stages``) those of the stage that writes
    ``writes`` data (``cold_start``, ``tool_demos``), else of its last stage."""
    if not (path and is_recipe(path)):
        return load_config(path, overrides)
    stages = load_recipe(path, overrides)
    return next((st.cfg for st in stages if writes and st.writes and st.writes[0] == writes), stages[-1].cfg)


def load_recipe(path: str | Path, cli_overrides: list[str]) -> list[Stage]:
    """Every stage's validated config, its Hub ids resolved; any problem is a ConfigError naming the recipe,
    stage and key."""
    from orchestrator.rl.launch import resolve_hub_ids

    path = Path(path)
    recipe = _read_yaml(path, "recipe")
    unknown = set(recipe) - RECIPE_KEYS
    if unknown:
        raise ConfigError(f"{path}: unknown recipe key(s) {sorted(unknown)}; allowed: {sorted(RECIPE_KEYS)}")
    base = recipe.get("base", {})
    base_tree = _read_yaml(path.parent / base, "base config") if isinstance(base, str) else dict(base)
    load_guard(recipe, path)
    stages = recipe.get("stages")
    if not isinstance(stages, list) or not stages:
        raise ConfigError(f"{path}: 'stages' must be a non-empty list of {{name, kind, overrides}}")
    root = _stage_tree(base_tree, cli_overrides, f"{path} (base + command line)")
    run_dir, names, out = Path(root["run"]["dir"]), set(), []
    for i, raw in enumerate(stages):
        where = f"{path}: stage {i + 1}"
        name, kind = _stage_head(raw, where, names)
        where = f"{where} ({name})"
        ovs = _overrides(raw.get("overrides"), where)
        if kind in PAIR_KINDS:  # the algorithm section becomes the kind's (other algorithms' keys do not carry over)
            if any(o.startswith("algorithm.name=") and o != f"algorithm.name={kind}" for o in ovs):
                raise ConfigError(f"{where}: a {kind} stage trains algorithm.name={kind}")
            ovs = ["algorithm={}", f"algorithm.name={kind}", *ovs]
        tree = _stage_tree(base_tree, [*ovs, *cli_overrides], where)
        tree.setdefault("run", {})["dir"] = str(run_dir / f"{i + 1:02d}-{name}")
        policies = [st for st in out if st.kind != "reward_model"]  # a reward model is not the next policy
        if policies and not any(o.startswith("model.path=") for o in ovs):
            tree.setdefault("model", {})["path"] = str(policies[-1].dir / "final")
        if not any(o.startswith("data.seed=") for o in ovs):  # each stage its own prompts, not stage 1's again
            tree["data"]["seed"] = root["data"]["seed"] + i
        cfg = resolve_hub_ids(FleetConfig.model_validate(tree))
        out.append(Stage(i + 1, name, kind, cfg, _writes(raw, kind, where), _hands(raw, cfg, where)))
    return out


def _hands(raw: dict, cfg: FleetConfig, where: str) -> str:
    """A stage's ``pass``: ``final`` (default) or ``best`` (needs ``trainer.keep_best``)."""
    hands = raw.get("pass", "final")
    if hands not in ("final", "best"):
        raise ConfigError(f"{where}: 'pass' must be final or best, got {hands!r}")
    if hands == "best" and not (cfg.trainer.keep_best and cfg.trainer.eval_every):
        raise ConfigError(f"{where}: 'pass: best' hands on the best evaluated policy: set trainer.keep_best (e.g. "
                          "eval/accuracy) and trainer.eval_every > 0 for this stage")
    return hands


def load_guard(recipe: dict, path) -> dict:
    """The recipe's ``guard`` over :data:`DEFAULT_GUARD`, checked."""
    given = recipe.get("guard") or {}
    guard = {**DEFAULT_GUARD, **given} if isinstance(given, dict) else None
    if guard is None or set(guard) != set(DEFAULT_GUARD) or guard["action"] not in GUARD_ACTIONS or \
            isinstance(guard["margin"], bool) or not isinstance(guard["margin"], int | float) or guard["margin"] < 0:
        raise ConfigError(f"{path}: 'guard' must be {{action: one of {list(GUARD_ACTIONS)}, margin: a number >= 0}}, "
                          f"got {given!r}")
    return guard


def _stage_head(raw, where: str, names: set[str]) -> tuple[str, str]:
    """A stage entry's checked ``(name, kind)`` (``names``: those taken by earlier stages; this one is added)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: must be a mapping {{name, kind, overrides}}")
    bad = set(raw) - STAGE_KEYS
    if bad:
        raise ConfigError(f"{where}: unknown key(s) {sorted(bad)}; allowed: {sorted(STAGE_KEYS)}")
    name, kind = raw.get("name"), raw.get("kind")
    if not isinstance(name, str) or not name.replace("_", "").replace("-", "").isalnum() or name in names:
        raise ConfigError(f"{where}: 'name' must be a unique word (letters, digits, _ or -), got {name!r}")
    names.add(name)
    if kind not in COMMANDS:
        raise ConfigError(f"{where} ({name}): unknown kind {kind!r}; allowed: {sorted(COMMANDS)}")
    return name, kind


def _writes(raw: dict, kind: str, where: str) -> tuple[str, int] | None:
    given = [k for k in DATA_KEYS if raw.get(k) is not None]
    if not given:
        return None
    n = raw[given[0]]
    if len(given) > 1 or kind not in DATA_KEYS[given[0]] or not isinstance(n, int) or isinstance(n, bool) or n < 1:
        kinds = ", ".join(f"{k} ({'|'.join(v)})" for k, v in DATA_KEYS.items())
        raise ConfigError(f"{where}: the rows to write first are one of {kinds}, on a stage of that kind, a "
                          f"positive integer; got {dict((k, raw[k]) for k in given)} on a {kind} stage")
    return given[0], n


def write_stage_data(kind: str, cfg: FleetConfig, n: int, out: Path, fleet) -> None:
    """The data a stage writes first: cold-start rows or tool demonstrations of its task, or Constitutional AI
    revisions or preference pairs from the stage's starting model, on the pipeline's ``fleet`` (its learner
    loads that model and pushes it into the engines, as ``fleetrl cai revise|prefer`` would start them)."""
    if kind in ("cai_revisions", "ai_preferences"):
        from orchestrator.recipes.cai import prefer, revise

        action = "revise" if kind == "cai_revisions" else "prefer"
        try:
            summary = (revise if action == "revise" else prefer)(cfg, n, out, fleet=fleet)
        except Exception as e:
            from orchestrator.telemetry.console import describe_failure

            raise StageFailed(f"fleetrl cai {action} for {out} failed: {describe_failure(e) or repr(e)}") from e
        print(f"pipeline: cai {action}: {json.dumps(summary)}", flush=True)
    elif kind == "tool_demos":
        from orchestrator.recipes.tool_demos import write_tool_demos

        write_tool_demos(cfg, n, out, cfg.data.seed)
    else:
        from orchestrator.recipes.cold_start import write_cold_start

        write_cold_start(cfg.data, n, out, cfg.data.seed)


def _stage_tree(base: dict, overrides: list[str], where: str) -> dict:
    tree = json.loads(json.dumps(base))
    for ov in overrides:
        try:
            apply_override(tree, ov)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
    try:
        return FleetConfig.model_validate(tree).model_dump(mode="json")
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e, where)) from None


def check_inputs(stages: list[Stage]) -> None:
    """Data files, pairs files and teachers of every stage, before anything starts."""
    from orchestrator.data import load_pairs, load_sft_rows
    from orchestrator.rl.launch import check_teacher

    for st in stages:
        where = f"stage {st.index} ({st.name})"
        try:
            if st.kind == "sft" and st.writes is None:
                if not st.cfg.sft.data:
                    raise ConfigError("sft.data: give a JSONL file, or cold_start: N / tool_demos: N to write one")
                load_sft_rows(st.cfg.sft.data)
            if st.kind in PAIR_KINDS and st.cfg.algorithm.pairs:
                load_pairs(st.cfg.algorithm.pairs)
            elif st.kind == "reward_model" and st.writes is None:
                raise ConfigError("algorithm.pairs: a reward_model stage trains on preference pairs; give a file, "
                                  "or ai_preferences: N to write them")
            if st.kind == "distill":
                check_teacher(st.cfg)
        except (ConfigError, DatasetError) as e:
            raise ConfigError(f"{where}: {e}") from None
    check_model_references(stages)
    first = stages[0].cfg.model.path
    from orchestrator.config import EMBEDDED_MODELS

    if first not in EMBEDDED_MODELS and not (Path(first) / "config.json").exists():
        raise ConfigError(f"stage 1 ({stages[0].name}): model.path {first!r} is not a model directory")


def check_model_references(stages: list[Stage]) -> None:
    """A stage whose ``model.path`` points into this pipeline's run dir must name an earlier stage's ``final``."""
    run_dir = stages[0].dir.parent.resolve()
    for i, st in enumerate(stages):
        path = Path(st.cfg.model.path).resolve()
        if run_dir not in path.parents:
            continue
        earlier = {(s.dir.resolve() / "final") for s in stages[:i]}
        if path not in earlier:
            names = [f"{s.dir.name}/final" for s in stages[:i]] or "none (it is the first stage)"
            raise ConfigError(f"stage {st.index} ({st.name}): model.path {st.cfg.model.path} is not an earlier "
                              f"stage's final policy; earlier: {names}")


class Summary:
    """``<run.dir>/summary.json``: one entry per stage, rewritten atomically after every change."""

    def __init__(self, path: Path, stages: list[Stage]):
        self.path = path
        old = {s["name"]: s for s in json.loads(path.read_text())["stages"]} if path.exists() else {}
        self.rows = [old.get(st.name) or {"name": st.name, "kind": st.kind, "status": "pending", "accuracy": None,
                                          "seconds": 0.0, "model": None, "attempts": 0, "resumed_from": None}
                     for st in stages]
        self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"stages": self.rows}, indent=1))
        tmp.replace(self.path)

    def table(self) -> str:
        lines = [f"{'stage':<20} {'kind':<8} {'status':<9} {'accuracy':>8} {'minutes':>8}  model"]
        for r in self.rows:
            acc = "-" if r["accuracy"] is None else f"{r['accuracy']:.3f}"
            lines.append(f"{r['name']:<20} {r['kind']:<8} {r['status']:<9} {acc:>8} {r['seconds'] / 60:>8.1f}  "
                         f"{r['model'] or '-'}")
        return "\n".join(lines)


def _prepare(st: Stage) -> list[str]:
    """Make the stage dir ready; returns the extra command-line arguments (``--resume auto`` after a crash)."""
    found = ckpt.complete_checkpoints(st.dir) if st.dir.exists() else []
    if found:
        return ["--resume", str(found[-1])]
    keep = {"distill_data.jsonl", "distill.json", *(f"{k}.jsonl" for k in DATA_KEYS)}
    if st.dir.exists():  # a start that wrote no checkpoint: begin the stage again
        for p in st.dir.iterdir():
            if p.name not in keep:
                shutil.rmtree(p) if p.is_dir() else p.unlink()
    return []


def run_stage(st: Stage, summary: Summary, row: dict, fleet) -> None:
    """Run one stage on ``fleet`` (its data written first), recording it in the summary."""
    extra = _prepare(st)
    st.dir.mkdir(parents=True, exist_ok=True)
    cfg = st.cfg
    config = st.dir / "stage.yaml"
    if st.writes:
        kind, n = st.writes
        data = st.dir / f"{kind}.jsonl"
        if not data.exists():
            config.write_text(dump_config(cfg))
            write_stage_data(kind, cfg, n, data, fleet)
        tree = cfg.model_dump(mode="json")
        if kind == "ai_preferences":
            tree["algorithm"]["pairs"] = str(data)
        else:
            tree["sft"]["data"] = str(data)
        cfg = FleetConfig.model_validate(tree)
    config.write_text(dump_config(cfg))
    resumed = extra[1] if extra else None
    row.update(status="running", attempts=row["attempts"] + 1, resumed_from=resumed)
    summary.write()
    print(f"pipeline: stage {st.index} {st.name} ({st.kind})" + (f", resuming from {resumed}" if resumed else ""),
          flush=True)
    t0 = time.time()
    try:
        run_kind(st.kind, cfg, resumed, fleet)
    except Exception as e:
        from orchestrator.telemetry.console import describe_failure

        row["status"] = "failed"
        summary.write()
        why = describe_failure(e) or f"{type(e).__name__}: {e}"
        raise StageFailed(f"stage {st.index} ({st.name}) failed: {why}; its log is in {st.dir / 'logs'}; rerun the "
                          "same command to resume it") from e
    finally:
        row["seconds"] = round(row["seconds"] + time.time() - t0, 1)
    result = json.loads((st.dir / "summary.json").read_text())
    row.update(status="finished", accuracy=result.get("eval_accuracy_last"), model=str(st.dir / "final"))
    summary.write()


def run_kind(kind: str, cfg: FleetConfig, resume: str | None, fleet) -> None:
    """A stage's training, as its command (:data:`COMMANDS`) runs it, on ``fleet``."""
    from orchestrator.rl.launch import ensure_model
    from rewards.reward_model import ensure_reward_model

    ensure_model(cfg)
    ensure_reward_model(cfg.reward.model.path, cfg.model.path)
    if kind == "sft":
        from orchestrator.loops.sft import run_sft

        run_sft(cfg, resume, fleet=fleet)
    elif kind == "rft":  # a recipe's rounds are its trainer.total_steps (so one override shrinks every stage)
        from orchestrator.loops.rft import run_rft

        run_rft(cfg, cfg.trainer.total_steps, resume, fleet=fleet)
    elif kind == "distill":
        from orchestrator.recipes.distill import run_distill

        run_distill(cfg, resume, fleet=fleet)
    else:
        from orchestrator.loops import train

        train(cfg, resume, fleet=fleet)


class StageFailed(RuntimeError):
    pass


def check_stage(st: Stage, row: dict, guard: dict) -> bool:
    """The stage guard on a finished stage (:data:`DEFAULT_GUARD`): records in ``row`` what the next stage trains
    from (``model``: the stage's final/ or best/, or with ``rollback`` the policy it was handed) and, when the
    stage lowered held-out accuracy past the margin, ``guard``; False when the pipeline must stop."""
    result = json.loads((st.dir / "summary.json").read_text())
    if st.hands == "best" and result.get("best"):
        row["model"] = str(st.dir / "best")
    first, end = result.get("eval_accuracy_first"), result.get("eval_accuracy_last")
    if st.hands == "best" and result.get("best"):
        end = result["best"]["value"]
    if first is None or end is None or first - end <= guard["margin"] + 1e-9:  # a drop of exactly the margin passes
        return True
    action = guard["action"]
    row["guard"] = {"start": first, "end": end, "margin": guard["margin"], "action": action}
    line = (f"pipeline: guard: stage {st.index} {st.name} lowered held-out accuracy {first:.3f} -> {end:.3f} "
            f"(margin {guard['margin']})")
    if action == "rollback":
        row["model"] = st.cfg.model.path
        line += f"; the next stage trains from the policy this stage was handed ({st.cfg.model.path})"
    print(line + ("" if action == "rollback" else f" (guard.action: {action})"), flush=True)
    return action != "stop"


def hand_on(st: Stage, model: str | None, stages: list[Stage]) -> None:
    """Later stages that train from ``st``'s final/ train from ``model`` instead (its best/, or a rollback)."""
    final = str(st.dir / "final")
    if not model or model == final:
        return
    for later in stages[st.index:]:
        if later.cfg.model.path == final:
            later.cfg = later.cfg.model_copy(update={"model": later.cfg.model.model_copy(update={"path": model})})


def run_pipeline(recipe: str, overrides: list[str], fleet=None) -> int:
    """`fleetrl pipeline`: every stage not finished yet, in order, on ``fleet`` (kept up afterwards) or on a
    fleet of its own; the exit status."""
    try:
        stages = load_recipe(recipe, overrides)
        check_inputs(stages)
    except ConfigError as e:
        print(f"fleetrl: {e}", file=sys.stderr)
        return 2
    run_dir = stages[0].dir.parent
    run_dir.mkdir(parents=True, exist_ok=True)
    summary = Summary(run_dir / "summary.json", stages)
    from orchestrator.rl.fleet import Fleet, Roles
    from orchestrator.rl.launch import init_ray

    init_ray(stages[0].cfg)
    own = fleet is None
    fleet = fleet or Fleet(stages[0].cfg, Roles())  # no actor yet: the first stage that runs starts what it uses
    guard = load_guard(_read_yaml(Path(recipe), "recipe"), recipe)
    try:
        for st, row in zip(stages, summary.rows):
            if row["status"] == "finished" and (st.dir / "final" / "config.json").exists():
                print(f"pipeline: stage {st.index} {st.name} finished already (accuracy {row['accuracy']})")
            else:
                run_stage(st, summary, row, fleet)
                if not check_stage(st, row, guard):
                    summary.write()
                    raise StageFailed(f"stage {st.index} ({st.name}) lowered held-out accuracy by more than "
                                      f"{guard['margin']} (guard.action: stop); its policy is {st.dir / 'final'}")
                summary.write()
            hand_on(st, row["model"], stages)
    except StageFailed as e:
        print(summary.table())
        print(f"fleetrl: {e}", file=sys.stderr)
        return 1
    finally:
        if own:
            fleet.stop()
    print(summary.table())
    return 0
