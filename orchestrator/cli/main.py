"""`fleetrl` command line: train, init-model, config show."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from orchestrator.config import EMBEDDED_MODEL_PATH, EMBEDDED_MODELS, ConfigError, FleetConfig, dump_config, load_config
from orchestrator.rl.launch import KIND_ARGS, ensure_model
from rewards.datasets import DatasetError


def _parser() -> argparse.ArgumentParser:
    from importlib.metadata import version

    p = argparse.ArgumentParser(prog="fleetrl", description="Distributed actor/learner RL post-training for LLMs.")
    p.add_argument("--version", action="version", version=f"%(prog)s {version('fleetrl')}")
    sub = p.add_subparsers(dest="command", required=True)
    tr = sub.add_parser("train", help="run RL training")
    _resume_args(tr)
    cf = sub.add_parser("config", help="show the resolved config, or the config reference")
    actions = cf.add_subparsers(dest="action", required=True)
    show = actions.add_parser("show", help="the resolved config as YAML, after every check a run makes at load")
    actions.add_parser("docs", help="the config reference table (docs/configuration.md)")
    dr = sub.add_parser("doctor", help="the engine/learner mismatch doctor: logprob gap of a small batch and its "
                        "cause (exit 1 above rollout.max_logprob_gap)")
    for sp in (tr, show, dr):
        sp.add_argument("-c", "--config", help="YAML config file")
        sp.add_argument("--stage", help="with a pipeline recipe as -c: the stage (its name) whose config to use")
        sp.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.group_size=8")
    _cluster_parsers(sub)
    _eval_parsers(sub)
    ex = sub.add_parser("export", help="write a run's (or checkpoint's) policy as an HF model directory")
    ex.add_argument("source", help="a run dir (its final policy, else its newest checkpoint) or a checkpoint dir")
    ex.add_argument("--out", required=True, help="a new (or empty) directory")
    ex.add_argument("--force", action="store_true", help="replace a non-empty --out directory")
    ex.add_argument("--adapter", action="store_true", help="a LoRA run: write the adapter alone (PEFT format) "
                    "instead of the merged model")
    im = sub.add_parser("init-model", help="build the embedded default model (tiny Qwen2 + char tokenizer), or "
                        "import a real one from GGUF (--from, --gguf) and check it against vLLM")
    src = im.add_mutually_exclusive_group()
    src.add_argument("--from", dest="from_name", metavar="NAME", help="a named model, e.g. smollm2-135m-instruct")
    src.add_argument("--gguf", metavar="FILE", help="a GGUF file (needs --out)")
    im.add_argument("--out", help=f"model directory (default: {EMBEDDED_MODEL_PATH}; .fleetrl/models/NAME with --from)")
    im.add_argument("--seed", type=int, default=0, help="embedded model only")
    im.add_argument("--kind", choices=sorted(KIND_ARGS), default="arith",
                    help="embedded model only: " + ", ".join(f"{k} ({p})" for p, k in EMBEDDED_MODELS.items()))
    im.add_argument("--target-accuracy", type=float, default=None,
                    help="embedded model only: stop the warm start at this accuracy")
    im.add_argument("--force", action="store_true", help="rebuild even if it exists")
    for sp in _run_starting(sub):
        sp.add_argument("--verbose", action="store_true", help="also show every actor's and engine's output on the "
                        "console (run.verbose=true); it is in <run.dir>/logs/ either way")
    return p


def _resume_args(parser: argparse.ArgumentParser) -> None:
    """A training command's ``--resume`` and ``--overwrite`` (one or the other): a run dir that holds an earlier run
    is refused without one (:func:`orchestrator.rl.checkpoint.check_new_run_dir`)."""
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--resume", help="'auto' (newest complete checkpoint of run.dir) or a checkpoint dir")
    how.add_argument("--overwrite", action="store_true", help="start over in a run.dir that holds an earlier run: "
                     "its metrics, checkpoints, final policy, evals and logs are deleted first")


def _run_starting(sub) -> list[argparse.ArgumentParser]:
    """The parsers of the commands that start actors (or a job that does): each takes ``--verbose``."""
    nested = [sp for name in ("cai", "prm") for sp in _actions(sub.choices[name]).values()]
    return [sub.choices[n] for n in ("train", "eval", "rft", "sft", "distill", "pipeline", "submit", "doctor")] + nested


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """A command's own subcommands (`cai revise`, `prm label`, ...) by name."""
    return next(a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction))


ADDRESS_HELP = ("the cluster: its job API http://HOST:8265, as `ray job` takes it (the GCS that scale, stop and "
                "status's run numbers join is derived: HOST:6379), or a GCS address HOST:PORT (the job API is then "
                "http://HOST:8265); default: RAY_ADDRESS. Never a Ray instance found on this machine")


def _cluster_parsers(sub) -> None:
    sm = sub.add_parser("submit", help="submit a training run to a Ray cluster as a Ray job")
    sm.add_argument("-c", "--config", help="YAML config file (inside the current directory, which is uploaded)")
    sm.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.num_workers=4")
    sm.add_argument("--address", help=ADDRESS_HELP)
    sm.add_argument("--python", default="python", help="python executable on the cluster nodes")
    sm.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="environment for the job")
    st = sub.add_parser("status", help="state, step, reward, eval accuracy and throughput of a submitted run")
    st.add_argument("job", nargs="?", help="job id (default: the newest fleetrl job)")
    st.add_argument("--address", help=ADDRESS_HELP)
    st.add_argument("--json", action="store_true", help="print JSON")
    sc = sub.add_parser("scale", help="resize a running job's rollout/reward/env pools (applied at the next step)")
    sc.add_argument("--rollout", type=int, help="rollout actors wanted")
    sc.add_argument("--reward", type=int, help="reward actors wanted")
    sc.add_argument("--env", type=int, help="env actors wanted (runs started with env.num_workers >= 1)")
    sc.add_argument("--run", help="run name (its run.dir's last component); default: the only live run")
    sc.add_argument("--address", help=ADDRESS_HELP)
    sc.add_argument("--wait", type=float, default=120.0, help="seconds to wait until applied (0: don't wait)")
    sp = sub.add_parser("stop", help="graceful stop of a running job at the next step boundary (final eval, final "
                        "policy, summary; the job ends SUCCEEDED)")
    sp.add_argument("--run", help="run name (its run.dir's last component); default: the only live run")
    sp.add_argument("--address", help=ADDRESS_HELP)
    sp.add_argument("--wait", type=float, default=300.0, help="seconds to wait until it ended (0: don't wait)")


def _cluster_command(args) -> int:

    from orchestrator.cli import jobs

    if args.command == "submit":
        env = dict(kv.split("=", 1) for kv in args.env)
        job = jobs.submit(args.config, args.overrides, args.address, args.python, env)
        addr, run = jobs.job_address(args.address), job.split("-", 1)[1].rsplit("-", 2)[0]
        print(f"submitted {job}\n  follow: ray job logs --address {addr} -f {job}\n"
              f"  status: fleetrl status {job} --address {addr}\n  scale:  fleetrl scale --run {run} --rollout N\n"
              f"  stop:   fleetrl stop --run {run}  (graceful; `ray job stop --address {addr} {job}` kills it)")
    elif args.command == "status":
        st = jobs.job_status(args.job, args.address)
        print(json.dumps(st) if args.json else jobs.format_status(st))
    elif args.command == "stop":
        print(json.dumps(jobs.stop(args.run, args.address, args.wait)))
    else:
        print(json.dumps(jobs.scale(args.rollout, args.reward, args.run, args.address, args.wait, env=args.env)))
    return 0


def _eval_parsers(sub) -> None:
    ev = sub.add_parser("eval", help="greedy accuracy, pass@k and best-of-N of a checkpoint on the eval prompts")
    ev.add_argument("-c", "--config", help="YAML config file (task, dataset, engines, reward functions)")
    ev.add_argument("--stage", help="with a pipeline recipe as -c: the stage (its name) whose config to use")
    ev.add_argument("--checkpoint", help="a run's final/, a checkpoint dir or an HF model dir (default with "
                    "--search: model.path)")
    ev.add_argument("--n", default="1,4,16", help="comma-separated k / N values (samples per prompt: the max)")
    ev.add_argument("--select", choices=["reward", "reward_model"], default="reward",
                    help="best-of-N picks the sample with the highest summed reward or reward-model score")
    ev.add_argument("--out", help="JSON report path (default: <run.dir>/eval.json); with --search a directory "
                    "(default: <run.dir>/search)")
    ev.add_argument("--search", metavar="METHODS", help="test-time search instead: comma-separated methods of "
                    "greedy, majority, orm_best_of_n, prm_best_of_n[:min|last|prod], prm_beam, mcts, revision")
    ev.add_argument("--budgets", default="1,4,16", help="with --search: comma-separated budgets N")
    ev.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.eval_size=100")
    ca = sub.add_parser("cai", help="Constitutional AI data from the policy on the rollout engines: `revise` "
                        "(SL-CAI: answers critiqued and revised against the principles, SFT rows) or `prefer` "
                        "(RL-CAI: response pairs labelled by a judge's option probabilities, DPO pairs); "
                        "settings in the cai section, docs/cai.md")
    cai_actions = ca.add_subparsers(dest="action", required=True)
    for name, help_ in (("revise", "SL-CAI: the policy's answers critiqued and revised against the principles "
                         "(SFT rows: messages, principles, revisions, critiques)"),
                        ("prefer", "RL-CAI: response pairs labelled by a judge's option probabilities (DPO pairs: "
                         "prompt, chosen, rejected, preference, principle)")):
        sp = cai_actions.add_parser(name, help=help_)
        sp.add_argument("-c", "--config", help="YAML config file (its data.task, cai section, engines)")
        sp.add_argument("--stage", help="with a pipeline recipe as -c: the stage (its name) whose config to use")
        sp.add_argument("--n", type=int, required=True, help="prompts (rows)")
        sp.add_argument("--out", required=True, help="JSONL file to write")
        sp.add_argument("overrides", nargs="*", help="dotted overrides, e.g. cai.judge=rule")
    pr = sub.add_parser("prm", help="process reward models: `label` the policy's steps by Monte-Carlo continuations "
                        "(Math-Shepherd), `train` a PRM on the labels")
    actions = pr.add_subparsers(dest="action", required=True)
    label = actions.add_parser("label", help="sample solutions, label every step by K continuations from its prefix")
    label.add_argument("--out", help="the JSONL to write (default: <run.dir>/prm_labels.jsonl)")
    train = actions.add_parser("train", help="train a PRM on the learner group (prm.labels or --labels)")
    train.add_argument("--labels", help="the labels JSONL (default: prm.labels)")
    _resume_args(train)
    for sp in (label, train):
        sp.add_argument("-c", "--config", help="YAML config file (task, model, engines, prm.*)")
        sp.add_argument("--stage", help="with a pipeline recipe as -c: the stage (its name) whose config to use")
        sp.add_argument("overrides", nargs="*", help="dotted overrides, e.g. prm.continuations=16")
    rf = sub.add_parser("rft", help="rejection-sampling fine-tuning: keep verified-correct samples, SFT on them")
    rf.add_argument("-c", "--config", help="YAML config file")
    rf.add_argument("--stage", help="with a pipeline recipe as -c: the stage (its name) whose config to use")
    rf.add_argument("--rounds", type=int, help="rounds (default: rft.rounds)")
    for name, help_ in (("sft", "supervised fine-tuning on sft.data (JSONL) on the learner group"),
                        ("distill", "a teacher (distill.teacher) answers training prompts, the verified answers are "
                         "kept, the student (model.path) is fine-tuned on them")):
        sp = sub.add_parser(name, help=help_)
        sp.add_argument("-c", "--config", help="YAML config file")
        sp.add_argument("--stage", help="with a pipeline recipe as -c: the stage (its name) whose config to use")
    for sp in (rf, *[sub.choices[n] for n in ("sft", "distill")]):
        _resume_args(sp)
        sp.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.group_size=8")
    pl = sub.add_parser("pipeline", help="run a recipe: stages (sft, rl, rft, distill, dpo) in order, each from the "
                        "previous stage's model; rerun the same command to resume after a crash")
    pl.add_argument("-c", "--config", required=True, help="recipe YAML: base config and stages")
    pl.add_argument("overrides", nargs="*", help="dotted overrides applied to every stage")
    da = sub.add_parser("data", help="write training data for a built-in task: cold-start SFT rows (step-by-step "
                        "answers), or tool demonstrations (chat conversations calling env.tools)")
    data_actions = da.add_subparsers(dest="action", required=True)
    for name, help_, tasks in (("cold-start", "cold-start SFT rows: step-by-step answers of a built-in task",
                                "arithmetic, countdown"),
                               ("tool-demos", "tool demonstrations: chat conversations calling env.tools",
                                "multiply, arithmetic, tool_choice")):
        sp = data_actions.add_parser(name, help=help_)
        sp.add_argument("-c", "--config", help="config YAML (tool-demos: its data.task, data.system_prompt, "
                        "env.tools)")
        sp.add_argument("--task", help=f"built-in task ({tasks}); default: the config's data.task")
        sp.add_argument("--n", type=int, required=True, help="rows")
        sp.add_argument("--out", required=True, help="JSONL file to write")
        sp.add_argument("overrides", nargs="*", help="data.* overrides, e.g. data.prompt_style=text")


def _data_command(args) -> int:
    if args.n < 1:
        raise ConfigError(f"--n {args.n}: write at least 1 row")
    overrides = [*([f"data.task={args.task}"] if args.task else []), *args.overrides]
    from orchestrator.recipes.pipeline import config_or_stage

    cfg = config_or_stage(args.config, overrides, writes=args.action.replace("-", "_"))
    if args.action == "tool-demos":
        from orchestrator.recipes.tool_demos import write_tool_demos

        print(json.dumps(write_tool_demos(cfg, args.n, args.out, cfg.data.seed)))
        return 0
    from orchestrator.recipes.cold_start import write_cold_start

    print(json.dumps(write_cold_start(cfg.data, args.n, args.out, cfg.data.seed)))
    return 0


def _config_command(args, cfg: FleetConfig, fleet) -> int:
    """The commands that take a run config (``-c``): evals and data from the engines, then the training ones; on
    ``fleet`` when given (see :func:`main`)."""
    if args.command == "eval":
        return _eval(args, cfg, fleet)
    if args.command == "cai":
        from orchestrator.recipes.cai import prefer, revise

        print(json.dumps((revise if args.action == "revise" else prefer)(cfg, args.n, args.out, fleet=fleet)))
        return 0
    if args.command == "doctor":
        from orchestrator.loops import loop_for
        from orchestrator.rl.driver import run_doctor

        d = run_doctor(cfg, loop=loop_for(cfg), fleet=fleet)
        print("\n".join(d.lines()))
        return 0 if d.healthy else 1
    if args.command == "prm" and args.action == "label":
        from orchestrator.loops.process_reward import run_label

        run_label(cfg, args.out or str(Path(cfg.run.dir) / "prm_labels.jsonl"), fleet=fleet)
        return 0
    return _training(lambda: _run_training_command(args, cfg, fleet), cfg)


def _eval(args, cfg: FleetConfig, fleet) -> int:
    from orchestrator.evaluation.evaluate import parse_ns, run_eval

    if args.search:
        from orchestrator.evaluation.search.driver import parse_methods, run_search

        run_search(cfg, args.checkpoint, parse_methods(args.search), parse_ns(args.budgets), args.out, fleet=fleet)
        return 0
    if not args.checkpoint:
        raise ConfigError("fleetrl eval: give --checkpoint (a run's final/, a checkpoint dir or an HF model dir)")
    run_eval(cfg, args.checkpoint, parse_ns(args.n), args.select, args.out, fleet=fleet)
    return 0


def _run_training_command(args, cfg: FleetConfig, fleet) -> None:
    """`train`, `prm train`, `rft`, `sft`, `distill`; ``--overwrite`` deletes the earlier run first."""
    if args.overwrite:
        from orchestrator.rl.checkpoint import clear_run

        gone = clear_run(Path(cfg.run.dir))
        if gone:
            print(f"fleetrl: --overwrite: deleted the earlier run's {', '.join(gone)} in {cfg.run.dir}", flush=True)
    if args.command == "prm":
        from orchestrator.loops.process_reward import run_prm_train

        if args.labels:
            cfg.prm.labels = args.labels
        run_prm_train(cfg, args.resume, fleet=fleet)
    elif args.command == "rft":
        from orchestrator.loops.rft import run_rft

        run_rft(cfg, args.rounds, args.resume, fleet=fleet)
    elif args.command == "sft":
        from orchestrator.loops.sft import run_sft

        run_sft(cfg, args.resume, fleet=fleet)
    elif args.command == "distill":
        from orchestrator.recipes.distill import run_distill

        run_distill(cfg, args.resume, fleet=fleet)
    else:
        from orchestrator.loops import train

        train(cfg, resume=args.resume, fleet=fleet, checked=True)


def _init_model(args) -> int:
    """`init-model`: the embedded model, or a real one converted from GGUF and checked against vLLM (built once:
    a second `init-model` meanwhile waits for it, :func:`~common.build_once.build_once`)."""
    from common.build_once import build_once
    from orchestrator.models import model_import

    if args.gguf is not None and args.out is None:
        print("fleetrl: init-model --gguf FILE needs --out DIR", file=sys.stderr)
        return 2
    real = args.from_name is not None or args.gguf is not None
    embedded = next(p for p, k in EMBEDDED_MODELS.items() if k == args.kind)
    out = Path(args.out or (model_import.default_dir(args.from_name) if real else embedded))
    try:
        built = build_once(out, lambda: _build_model(args, out, real), force=args.force)
    except (model_import.ModelImportError, FileExistsError) as e:
        print(f"fleetrl: {e}", file=sys.stderr)
        return 2
    if not built:
        print(f"{out} exists (use --force to rebuild)")
    return 0


def _build_model(args, out: Path, real: bool) -> None:
    """`init-model`'s build: the embedded model of ``--kind``, or the GGUF converted and checked against vLLM."""
    from orchestrator.models import model_import

    if not real:
        from orchestrator.models.embedded_model import init_model

        kwargs = dict(KIND_ARGS[args.kind])
        if args.kind in ("arith", "think", "chain") and args.target_accuracy is not None:
            kwargs["target_accuracy"] = args.target_accuracy
        print(init_model(out, seed=args.seed, **kwargs))
        return
    gguf = args.gguf or model_import.packaged_gguf(args.from_name)
    info = model_import.import_gguf(gguf, out, overwrite=args.force)
    print(model_import.format_summary(info, info["check"]))


def _training(run, cfg: FleetConfig) -> int:
    """Run a training command: a failure inside an actor is reported with the actor's name and its log file."""
    from orchestrator.rl.collect import RewardsFailing
    from orchestrator.rl.doctor import MismatchRefused
    from orchestrator.rl.driver import PREEMPTED_EXIT, BadTraining, CheckpointFailed, Preempted
    from orchestrator.rl.learner_group import LearnerDied
    from orchestrator.telemetry.console import describe_failure

    try:
        run()
    except Preempted:  # the driver printed where it stopped and the checkpoint to resume from
        return PREEMPTED_EXIT
    except (LearnerDied, BadTraining, CheckpointFailed, RewardsFailing, MismatchRefused) as e:
        print(f"fleetrl: {e}", file=sys.stderr)
        return 1
    except Exception as e:
        failed = describe_failure(e)
        if failed is None:
            raise
        print(f"fleetrl: {failed}\n  driver log: {Path(cfg.run.dir) / 'logs' / 'driver.log'}", file=sys.stderr)
        return 1
    return 0


def load_run_config(path: str | None, overrides: list[str], stage: str | None) -> FleetConfig:
    """A run config, or with ``--stage NAME`` that stage of a pipeline recipe, its Hub ids resolved to local
    snapshots (:func:`orchestrator.rl.launch.resolve_hub_ids`); a recipe without ``--stage`` (or ``--stage`` on a
    run config) is a ConfigError saying which to give."""
    from orchestrator.rl.launch import resolve_hub_ids

    return resolve_hub_ids(_read_run_config(path, overrides, stage))


def _read_run_config(path: str | None, overrides: list[str], stage: str | None) -> FleetConfig:
    from orchestrator.recipes.pipeline import is_recipe, load_recipe

    if not (path and is_recipe(path)):
        if stage is not None:
            raise ConfigError(f"--stage {stage}: {path or 'the defaults'} is a run config, not a pipeline recipe "
                              "(it has no stages)")
        return load_config(path, overrides)
    stages = load_recipe(path, overrides)
    names = [st.name for st in stages]
    if stage is None:
        raise ConfigError(f"{path} is a pipeline recipe (stages {', '.join(names)}): run it with `fleetrl pipeline "
                          f"-c {path}`, or give one stage's config with --stage NAME")
    if stage not in names:
        raise ConfigError(f"--stage {stage!r}: {path} has the stages {names}")
    return stages[names.index(stage)].cfg


def show_config(path: str | None, overrides: list[str], stage: str | None) -> str:
    """`config show`: the resolved config as YAML, after every check a run of it makes at load
    (:func:`orchestrator.loops.prepare`); a pipeline recipe without ``--stage``: every stage's, after the
    pipeline's own checks."""
    from orchestrator.loops import prepare
    from orchestrator.recipes.pipeline import check_inputs, is_recipe, load_recipe

    if path and is_recipe(path) and stage is None:
        stages = load_recipe(path, overrides)
        check_inputs(stages)
        return "".join(f"# stage {st.index}: {st.name} ({st.kind}), run dir {st.dir}\n{dump_config(st.cfg)}"
                       for st in stages)
    cfg = load_run_config(path, overrides, stage)
    prepare(cfg)
    return dump_config(cfg)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; dotted ``key=value`` overrides may come before or after the options (argparse alone takes
    them only in one run)."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    stray = [x for x in extra if x.startswith("-") or "=" not in x]
    if stray or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    if getattr(args, "verbose", False):  # --verbose is run.verbose=true, whichever command starts the run
        args.overrides = [*args.overrides, "run.verbose=true"]
    return args


def check_and_build(args, cfg: FleetConfig) -> FleetConfig:
    """`train`: every input checked (:func:`orchestrator.loops.prepare`, once: the prepared config is what the run
    gets) before Ray starts or a file is written; the run builds the embedded model after its last check
    (:func:`orchestrator.rl.driver.run_training`). Other
    commands: the model, built when it is the embedded one and missing (`eval`: the checkpoint it evaluates, after
    its selector is checked; the default model is not built for a checkpoint that is not it)."""
    command = args.command
    if command == "eval":
        from orchestrator.evaluation.evaluate import check_selector, resolve_model_dir

        check_selector(cfg, args.select)
        if args.checkpoint and not args.search:  # the model evaluated is the checkpoint, not model.path
            if args.checkpoint in EMBEDDED_MODELS:
                ensure_model(cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": args.checkpoint})}))
            resolve_model_dir(args.checkpoint)
            return cfg
    if command not in ("train", "doctor"):
        ensure_model(cfg)
        return cfg
    from orchestrator.loops import prepare

    return prepare(cfg)


def _import_from_cwd() -> None:
    """Plugins named by import path (``env.agent``, reward functions, tools, tasks) resolve from the working
    directory as under ``python -m``; the ``fleetrl`` script's own ``sys.path[0]`` is its bin directory. Ray gives
    the local actors the driver's ``sys.path``, so they find the same modules (a cluster job ships the directory
    as its ``working_dir``)."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


def main(argv: list[str] | None = None, fleet=None) -> int:
    """Run one command; its exit status. ``fleet``: an :class:`orchestrator.rl.fleet.Fleet` of this process that
    the command runs on, kept up afterwards (a process that runs several commands in turn, as a pipeline does)."""
    args = parse_args(argv)
    _import_from_cwd()
    if args.command != "train":  # a training run logs to <run.dir>/logs/driver.log (orchestrator.telemetry.console)
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        if args.command in ("submit", "status", "scale", "stop"):
            try:
                return _cluster_command(args)
            except (LookupError, ValueError, TimeoutError) as e:  # no such run/job, bad --rollout, not applied
                print(f"fleetrl: {e}", file=sys.stderr)
                return 2
        if args.command in COMMANDS_WITHOUT_CONFIG:
            return COMMANDS_WITHOUT_CONFIG[args.command](args, fleet)
        if args.command == "config":
            return _config(args)
        cfg = load_run_config(args.config, args.overrides, args.stage)
        cfg = check_and_build(args, cfg)
        from rewards.reward_model import ensure_reward_model

        ensure_reward_model(cfg.reward.model.path, cfg.model.path)
        return _config_command(args, cfg, fleet)
    except (ConfigError, FileNotFoundError, DatasetError) as e:
        print(f"fleetrl: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        from orchestrator.rl.pools import StartupTimeout

        if not isinstance(e, StartupTimeout):
            raise
        print(f"fleetrl: {e}", file=sys.stderr)
        return 1


def _export(args) -> int:
    from orchestrator.rl.checkpoint import export_policy

    try:
        print(export_policy(Path(args.source), Path(args.out), adapter=args.adapter, force=args.force))
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"fleetrl: {e}", file=sys.stderr)
        return 2
    return 0


def _config(args) -> int:
    """`config show` (the resolved config, after the checks a run makes at load) or `config docs`."""
    if args.action == "docs":
        from orchestrator.config.docs import config_reference_markdown

        print(config_reference_markdown(), end="")
    else:
        print(show_config(args.config, args.overrides, args.stage), end="")
    return 0


def _pipeline(args, fleet) -> int:
    from orchestrator.recipes.pipeline import run_pipeline

    return run_pipeline(args.config, args.overrides, fleet)


COMMANDS_WITHOUT_CONFIG = {"init-model": lambda a, _: _init_model(a), "export": lambda a, _: _export(a),
                           "pipeline": _pipeline, "data": lambda a, _: _data_command(a)}
"""Commands that load no run config of their own, called with the arguments and the caller's fleet (``config docs``
is handled beside ``config show``)."""


if __name__ == "__main__":
    sys.exit(main())
