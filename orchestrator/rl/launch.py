"""What a run needs before its loop starts, shared by training, eval, search, distillation and PRM labelling:
Ray (joined or started with enough CPUs), the task, the driver's tokenizer, the engines' context length."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path

from orchestrator.config import EMBEDDED_MODEL_PATH, EMBEDDED_MODELS, ConfigError, FleetConfig
from rewards.tasks import make_task_from_config

log = logging.getLogger("fleetrl")


def init_ray(cfg: FleetConfig) -> str | None:
    """Join ``run.ray_address`` (or RAY_ADDRESS, as inside a Ray job), or start a private local Ray instance with
    enough CPUs for the configured actors, every port of it bound to 127.0.0.1 (:func:`_loopback_node`; a run
    reachable from other machines joins a cluster started with ``ray start``: docs/cluster.md). Actors' output
    reaches this console only with ``run.verbose`` (it is in their log files either way). Returns where the Ray
    dashboard is, for the banner."""
    import math

    import ray

    if ray.is_initialized():
        return None
    address = cfg.run.ray_address or os.environ.get("RAY_ADDRESS")
    quiet = {"log_to_driver": cfg.run.verbose, "logging_level": logging.INFO if cfg.run.verbose else logging.ERROR}
    if not address:
        with _loopback_node():
            ray.init(num_cpus=max(os.cpu_count() or 1, math.ceil(_cpus_needed(cfg))), include_dashboard=False,
                     **quiet)
        return "off (a private local Ray instance on 127.0.0.1; join a cluster with run.ray_address)"
    url = getattr(ray.init(address=address, **quiet), "dashboard_url", None)
    return (f"http://{url}" if not url.startswith("http") else url) if url else f"the cluster's ({address})"


MODEL_KEYS = ("model.path", "distill.teacher", "reward.model.path", "prm.path", "prm.orm_path")
DATASET_KEYS = ("data.path", "data.eval_path", "sft.data", "algorithm.pairs")
"""The keys that take a model or a dataset: a local path or a Hub id (:func:`resolve_hub_ids`)."""


def resolve_hub_ids(cfg: FleetConfig) -> FleetConfig:
    """``cfg`` with every Hub id among :data:`MODEL_KEYS` and :data:`DATASET_KEYS` rewritten to its snapshot
    directory in the Hub cache (:func:`common.hub.resolve`), ``model.source`` and ``data.source`` recording what
    ``model.path`` and ``data.path`` resolved to; a ConfigError naming the key when an id cannot be had. Local
    paths and the embedded models are left as they are; a config without Hub ids is returned unchanged."""
    from common.hub import HubError, resolve

    tree, sources = cfg.model_dump(mode="json"), {}
    for keys, repo_type in ((MODEL_KEYS, "model"), (DATASET_KEYS, "dataset")):
        for key in keys:
            section, _, name = key.rpartition(".")
            node = _node(tree, section)
            ref = node.get(name) if node is not None else None
            if not isinstance(ref, str) or ref in EMBEDDED_MODELS:
                continue
            revision = cfg.model.revision if key == "model.path" else None
            try:
                found = resolve(ref, key, revision, repo_type)
            except HubError as e:
                raise ConfigError(str(e)) from None
            if found.source:
                node[name], sources[key] = found.path, found.source
    if not sources:
        return cfg
    tree["model"]["source"] = sources.get("model.path", cfg.model.source)
    tree["data"]["source"] = sources.get("data.path", cfg.data.source)
    for key, source in sources.items():
        log.info("%s: %s -> %s", key, source, _node(tree, key.rpartition(".")[0])[key.rpartition(".")[2]])
    return FleetConfig.model_validate(tree)


def _node(tree: dict, dotted: str) -> dict | None:
    for part in dotted.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree if isinstance(tree, dict) else None


@contextlib.contextmanager
def _loopback_node():
    """While a private Ray instance starts: its node's address is 127.0.0.1, so its GCS, raylet, object manager,
    agents and workers listen on loopback only (Ray binds a node advertised as 127.0.0.1 there, any other address
    on every interface). On Linux Ray advertises the address of the interface that routes outward (and maps a
    given 127.0.0.1 to it) unless told it runs as a single-machine instance, as on macOS and Windows
    (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, read at Ray's import, hence set on its constant too). The processes
    started meanwhile keep the setting; this process's own is restored after."""
    from ray._private import ray_constants

    name, before = ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR, ray_constants.ENABLE_RAY_CLUSTER
    env = os.environ.get(name)
    os.environ[name], ray_constants.ENABLE_RAY_CLUSTER = "0", False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before
        if env is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = env


def make_task(cfg: FleetConfig):
    """The built-in task, or a JSONL dataset (``data.path``) with prompts filtered by token length."""
    d = cfg.data
    if d.path is None:
        return make_task_from_config(d)
    from rewards.datasets import DatasetTask, Splits
    from workers.prompts import PromptRenderer, use_chat_template

    renderer = PromptRenderer(use_chat_template(load_tokenizer(cfg.model.path), d.chat_template), d.prompt_format,
                              d.system_prompt, d.chat_template_kwargs)
    # a prompt must fit the engines' context too (the model's may be shorter than data.max_prompt_tokens)
    limit = min(d.max_prompt_tokens, max_model_len(cfg) - 1)
    task = DatasetTask(d.path, d.prompt_field, d.answer_field, d.skip_invalid, d.eval_size, d.seed,
                       too_long=lambda p: len(renderer.render(p)[1]) > limit, verifier=d.verifier,
                       answer_form=d.answer_form, splits=Splits(d.config, d.split, d.eval_split, d.eval_path))
    log.info("dataset %s: %d train / %d eval rows; skipped %s", d.path, len(task.train_rows), len(task.eval_rows),
             task.counts)
    return task


def load_tokenizer(path: str):
    """The model directory's tokenizer; the embedded model's before it is built (its tokenizer is fixed by its
    kind), so inputs are measured in its tokens before the 1.5-min build. A path that is no directory is a
    ConfigError naming ``model.path`` (not the hub's "Repo id must be in the form..." from transformers)."""
    from common.imports import import_transformers

    if path in EMBEDDED_MODELS and not (Path(path) / "tokenizer.json").exists():
        from orchestrator.models.embedded_model import saved_tokenizer_of

        return saved_tokenizer_of(EMBEDDED_MODELS[path])
    if not Path(path).is_dir():
        raise ConfigError(f"model.path: {path!r} is not a model directory: give a local HF model directory or a "
                          "Hub id org/name (`fleetrl init-model --gguf FILE.gguf --out DIR` converts a GGUF file)")

    import_transformers()  # without its scikit-learn hook: 2.5 s less of every run's start-up
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def max_model_len(cfg: FleetConfig) -> int:
    """Engine context: the prompt limit plus the completion cap (an episode's token budget with ``env``), within
    the model's position range."""
    wanted = cfg.env.max_total_tokens if cfg.env.multi_turn else cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    config = Path(cfg.model.path) / "config.json"
    hf = json.loads(config.read_text()) if config.exists() else {}  # not built yet (the embedded model): no cap
    return min(int(hf.get("max_position_embeddings", 1 << 30)), wanted)


def _cpus_needed(cfg: FleetConfig) -> float:
    """The CPUs of every group ``cfg`` configures (:func:`resource_demand`)."""
    prm = bool(cfg.prm.path or cfg.prm.orm_path)
    roles = {"learner": True, "critic": cfg.algorithm.uses_critic, "rollout": True, "reward": True,
             "env": bool(cfg.env.name), "prm": prm, "orm": prm, "teacher": cfg.algorithm.uses_teacher,
             "feedback": bool(cfg.judge_spec) and cfg.cai.judge == "model"}
    return sum(resource_demand(cfg, [r for r, used in roles.items() if used]).get("CPU", {}).values())


def resource_demand(cfg: FleetConfig, roles: Iterable[str]) -> dict[str, dict[str, float]]:
    """Per resource (CPU, GPU and custom ones), what the actors of each of ``roles`` (the names of
    :class:`orchestrator.rl.fleet.Roles`) ask of the cluster in all."""
    lc, r, rm, out = cfg.learner, cfg.rollout, cfg.reward.model, {}
    engine, ranks = (r.num_cpus, r.num_gpus * r.tensor_parallel_size, r.resources), \
        (lc.num_ranks, lc.num_cpus, lc.num_gpus, lc.resources)
    prm = (cfg.prm.num_workers, cfg.prm.num_cpus, 0.0, {})
    asks = {  # role -> (actors, CPUs, GPUs, custom resources) of each kind of actor in its group
        "learner": [ranks], "critic": [ranks], "rollout": [(r.num_workers, *engine)],
        "teacher": [(cfg.distill.teacher_workers, *engine)], "feedback": [(1, *engine)],
        "reward": [(cfg.reward.num_workers, cfg.reward.num_cpus, 0.0, cfg.reward.resources)]
        + ([(rm.num_workers, rm.num_cpus, 0.0, {})] if rm.path else []),
        "env": [(cfg.env.num_workers, cfg.env.num_cpus, 0.0, {})], "prm": [prm], "orm": [prm]}
    for role in roles:
        for count, cpus, gpus, resources in asks.get(role, []):
            for name, each in {"CPU": cpus, "GPU": gpus, **resources}.items():
                if each:
                    out.setdefault(name, {})[role] = out.get(name, {}).get(role, 0.0) + count * each
    return out


KIND_ARGS = {"arith": {"kind": "arith"}, "think": {"kind": "think"},
             "calc": {"kind": "calc", "target_accuracy": None, "max_steps": 400, "batch_size": 128},
             "chain": {"kind": "chain", "target_accuracy": 0.3, "max_steps": 3000, "lr": 2e-3, "batch_size": 128}}
"""How each embedded model is warm-started: the default to a target accuracy, the calculator model for a fixed
number of steps (its demonstrations teach the tool format; accuracy without the tool stays near 0), the step
model to 30% whole-solution accuracy (the middle of the 20-60% a process-supervision study wants)."""


def check_model_dir(path: Path, key: str) -> None:
    """A model directory a run can load: config.json parses and names a causal LM, and weights are there (a
    ConfigError naming ``key``, the file and what is wrong)."""
    try:
        archs = json.loads((path / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError) as e:
        raise ConfigError(f"{key}: {path / 'config.json'} is not a readable JSON config ({type(e).__name__})") \
            from None
    if archs and not any(a.endswith("ForCausalLM") for a in archs):
        raise ConfigError(f"{key}: {path} is a {archs[0]}, not a causal LM (its architectures must end in "
                          "ForCausalLM, e.g. Qwen2ForCausalLM)")
    weights = [*path.glob("*.safetensors"), *path.glob("pytorch_model*.bin"), *path.glob("*.safetensors.index.json")]
    if not weights:
        raise ConfigError(f"{key}: {path} has a config.json but no weights (*.safetensors or pytorch_model*.bin)")


def check_teacher(cfg: FleetConfig) -> Path:
    """``distill.teacher``: a local model directory (offline and on-policy distillation read it; a Hub id was
    resolved to one at load)."""
    teacher = cfg.distill.teacher
    if not teacher:
        raise ConfigError("distill.teacher: give the teacher's local HF model directory or Hub id")
    if not (Path(teacher) / "config.json").exists():
        raise ConfigError(f"distill.teacher: {teacher!r} is not a model directory (no config.json there)")
    return Path(teacher)


def ensure_model(cfg: FleetConfig) -> None:
    """Build the embedded model when it is the configured one and missing; fail clearly for other paths."""
    path = Path(cfg.model.path)
    if (path / "config.json").exists():
        check_model_dir(path, "model.path")
        return
    if cfg.model.path in EMBEDDED_MODELS:
        from common.build_once import build_once
        from orchestrator.models.embedded_model import init_model

        kind = EMBEDDED_MODELS[cfg.model.path]

        def build() -> None:
            print(f"embedded model missing: building it in {path} (fleetrl init-model --kind {kind})", flush=True)
            init_model(path, seed=cfg.model.init_seed, **KIND_ARGS[kind])

        build_once(path, build)
        return
    raise ConfigError(f"model.path: {cfg.model.path!r} is not a model directory (no config.json there); "
                      f"give a local HF model directory, a Hub id org/name, or leave the default "
                      f"{EMBEDDED_MODEL_PATH!r}")
