"""`fleetrl` command line: train, init-model, config show."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from orchestrator.config import EMBEDDED_MODEL_PATH, ConfigError, FleetConfig, dump_config, load_config
from rewards.datasets import DatasetError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fleetrl", description="Distributed actor/learner RL post-training for LLMs.")
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_ in (("train", "run RL training"), ("config", "show the resolved config")):
        sp = sub.add_parser(name, help=help_)
        if name == "config":
            sp.add_argument("action", choices=["show", "docs"], help="show: resolved YAML; docs: reference table")
        sp.add_argument("-c", "--config", help="YAML config file")
        if name == "train":
            sp.add_argument("--resume", help="'auto' (newest complete checkpoint of run.dir) or a checkpoint dir")
        sp.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.group_size=8")
    ex = sub.add_parser("export", help="write a run's (or checkpoint's) policy as an HF model directory")
    ex.add_argument("source", help="a run dir (its final policy, else its newest checkpoint) or a checkpoint dir")
    ex.add_argument("--out", required=True)
    im = sub.add_parser("init-model", help="build the embedded default model (tiny Qwen2 + char tokenizer)")
    im.add_argument("--out", default=EMBEDDED_MODEL_PATH)
    im.add_argument("--seed", type=int, default=0)
    im.add_argument("--target-accuracy", type=float, default=0.2, help="stop the warm start at this accuracy")
    im.add_argument("--force", action="store_true", help="rebuild even if it exists")
    return p


def ensure_model(cfg: FleetConfig) -> None:
    """Build the embedded model when it is the configured one and missing; fail clearly for other paths."""
    path = Path(cfg.model.path)
    if (path / "config.json").exists():
        return
    if cfg.model.path == EMBEDDED_MODEL_PATH:
        from orchestrator.embedded_model import init_model

        print(f"embedded model missing: building it in {path} (fleetrl init-model)", flush=True)
        init_model(path, seed=cfg.model.init_seed)
        return
    raise ConfigError(f"model.path: {cfg.model.path!r} is not a model directory (no config.json there); "
                      f"give a local HF model directory, or leave the default {EMBEDDED_MODEL_PATH!r}")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        if args.command == "init-model":
            from orchestrator.embedded_model import init_model

            if (Path(args.out) / "config.json").exists() and not args.force:
                print(f"{args.out} exists (use --force to rebuild)")
                return 0
            print(init_model(args.out, seed=args.seed, target_accuracy=args.target_accuracy))
            return 0
        if args.command == "export":
            from orchestrator.checkpoint import export_policy

            print(export_policy(Path(args.source), Path(args.out)))
            return 0
        if args.command == "config" and args.action == "docs":
            from orchestrator.config import config_reference_markdown

            print(config_reference_markdown(), end="")
            return 0
        cfg = load_config(args.config, args.overrides)
        if args.command == "config":
            print(dump_config(cfg), end="")
            return 0
        ensure_model(cfg)
        from orchestrator.pools import LearnerDied
        from orchestrator.trainer import run_training

        try:
            run_training(cfg, resume=args.resume)
        except LearnerDied as e:
            print(f"fleetrl: {e}", file=sys.stderr)
            return 1
        return 0
    except (ConfigError, FileNotFoundError, DatasetError) as e:
        print(f"fleetrl: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
