"""Checkpoint directories of a run: ``<run.dir>/checkpoints/step_NNNNNN``.

A checkpoint is written under a temporary name, the completion marker ``COMPLETE`` is written last, then the
directory is renamed into place; only complete checkpoints are ever loaded, and the last
``trainer.keep_checkpoints`` are kept. Contents: ``learner/`` and ``critic/`` (DeepSpeed state per rank:
weights, optimizer, LR schedule, each rank's RNG), ``policy/`` (the policy as an HF safetensors directory),
``trainer_state.json`` (next step, policy version), ``config.yaml``, and in ``rollout.mode: one_step_off`` the
batch in flight (``in_flight.json``: the next step's scored samples, generated with the weights one version
older than the checkpoint's, which a resumed run could not regenerate).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

from orchestrator.config import ConfigError
from workers.records import Collected, EpisodeStats, Sample, ScoredSample

MARKER = "COMPLETE"


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def staging_dir(run_dir: Path, step: int) -> Path:
    path = checkpoint_root(run_dir) / f".tmp-step_{step:06d}"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def commit(run_dir: Path, staging: Path, step: int, state: dict, config_yaml: str, keep: int) -> Path:
    """Write the driver state and marker, rename into place, prune old checkpoints."""
    (staging / "trainer_state.json").write_text(json.dumps(state, indent=1))
    (staging / "config.yaml").write_text(config_yaml)
    (staging / MARKER).write_text("ok\n")
    final = checkpoint_root(run_dir) / f"step_{step:06d}"
    shutil.rmtree(final, ignore_errors=True)
    staging.rename(final)
    for old in complete_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def save_in_flight(staging: Path, batch: Collected) -> None:
    """The batch in flight, as JSON (floats written exactly; loading it runs no code)."""
    record = {"scored": [dataclasses.asdict(x) for x in batch.scored], "reward_errors": batch.reward_errors,
              "sampling": batch.info}
    (staging / "in_flight.json").write_text(json.dumps(record))


def load_in_flight(path: Path) -> Collected | None:
    """The batch a checkpoint had in flight, or None."""
    file = path / "in_flight.json"
    if not file.exists():
        return None
    record = json.loads(file.read_text())
    scored = [ScoredSample(_sample(x["sample"]), x["reward"], x["components"]) for x in record["scored"]]
    return Collected(scored, record["reward_errors"], record["sampling"])


def _sample(fields: dict) -> Sample:
    episode = fields.get("episode")
    return Sample(**{**fields, "episode": EpisodeStats(**episode) if episode else None})


def complete_checkpoints(run_dir: Path) -> list[Path]:
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if (p / MARKER).exists())


def resolve(resume: str, run_dir: Path) -> Path:
    """``auto``: the newest complete checkpoint of the run dir; otherwise a checkpoint directory."""
    if resume == "auto":
        found = complete_checkpoints(run_dir)
        if not found:
            raise FileNotFoundError(f"--resume auto: no complete checkpoint under {checkpoint_root(run_dir)}")
        return check_checkpoint(found[-1])
    path = Path(resume)
    if not (path / MARKER).exists():
        raise FileNotFoundError(f"--resume {resume}: not a complete fleetrl checkpoint (no {MARKER} marker)")
    return check_checkpoint(path)


def check_checkpoint(path: Path) -> Path:
    """A checkpoint a run can resume from: its state file parses and its learner state is there (a
    FileNotFoundError naming what is missing or broken)."""
    state = path / "trainer_state.json"
    try:
        fields = json.loads(state.read_text())
        int(fields["step"]), int(fields["policy_version"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise FileNotFoundError(f"checkpoint {path}: {state.name} is missing or broken ({type(e).__name__}: "
                                f"{str(e)[:120]}); resume from another checkpoint") from None
    if not (path / "learner").is_dir():
        raise FileNotFoundError(f"checkpoint {path}: no learner state (learner/); resume from another checkpoint")
    return path


RUN_OUTPUTS = ("metrics.jsonl", "summary.json", "final", "best", "checkpoints", "config.yaml", "status.json",
               "trackers.json", "progress.png", "evals", "rollouts", "logs", "tensorboard", "wandb", "mlflow.db",
               "mlflow-artifacts")
"""What a training run writes in its run dir (``--overwrite`` deletes these and nothing else: a distill run's teacher
data, a PRM run's labels and any file of the user's stay)."""


def earlier_run(run_dir: Path) -> list[str]:
    """What of an earlier run ``run_dir`` holds: the steps it logged, its summary, final policy, checkpoints."""
    metrics = run_dir / "metrics.jsonl"
    found = ["metrics.jsonl"] if metrics.exists() and metrics.stat().st_size else []
    found += [name for name in ("summary.json", "final") if (run_dir / name).exists()]
    root = checkpoint_root(run_dir)
    return found + (["checkpoints/"] if root.is_dir() and any(root.glob("step_*")) else [])


def check_new_run_dir(run_dir: Path) -> None:
    """A run that is not resumed starts in a run dir without an earlier run (else a ConfigError naming the ways
    out), so no run's metrics and checkpoints are ever silently replaced."""
    found = earlier_run(run_dir)
    if found:
        raise ConfigError(f"run.dir={run_dir} holds an earlier run ({', '.join(found)}): continue it with "
                          "`--resume auto`, or start over with `--overwrite` (deletes that run's files), or give "
                          "another run.dir")


def clear_run(run_dir: Path) -> list[str]:
    """``--overwrite``: delete what an earlier run wrote in ``run_dir`` (:data:`RUN_OUTPUTS`); the names deleted."""
    gone = [name for name in RUN_OUTPUTS if (run_dir / name).exists()]
    for name in gone:
        path = run_dir / name
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    return gone


def load_state(path: Path) -> dict:
    return json.loads((path / "trainer_state.json").read_text())


def export_policy(source: Path, out: Path, adapter: bool = False, force: bool = False) -> Path:
    """Copy the policy of a checkpoint (``policy/``) or run dir (``final/``, else its newest checkpoint) to
    ``out`` as an HF directory (safetensors + tokenizer) that transformers and vLLM load. A LoRA run's policy is
    the merged model; ``adapter`` copies its ``adapter/`` (PEFT's format: ``PeftModel.from_pretrained`` on the
    base, or a vLLM ``LoRARequest``) instead. ``out`` must be new or empty (``force``: replaced); every weights
    file is read through before anything is written, and the copy lands under a temporary name first."""
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"export --out {out}: a file is there; give a directory path")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise FileExistsError(f"export --out {out}: not empty; give a new directory, or --force to replace it")
    if (source / MARKER).exists():
        policy = source / "policy"
    elif (source / "final" / "config.json").exists():
        policy = source / "final"
    elif complete_checkpoints(source):
        policy = complete_checkpoints(source)[-1] / "policy"
    else:
        raise FileNotFoundError(f"export: {source} is neither a checkpoint nor a run dir with a final policy "
                                "or a complete checkpoint")
    if adapter:
        if not (policy / "adapter" / "adapter_config.json").exists():
            raise FileNotFoundError(f"export --adapter: {policy} has no adapter/ (the run did not train LoRA "
                                    "adapters: learner.lora.rank was 0)")
        policy = policy / "adapter"
    check_weights(policy)
    tmp = out.with_name(f".{out.name}.export-tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(policy, tmp, ignore=shutil.ignore_patterns("adapter"))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def check_weights(model_dir: Path) -> None:
    """Every ``*.safetensors`` file of ``model_dir`` is whole: its header parses and its tensors fit the file (a
    truncated copy is a ValueError naming it)."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"export: {model_dir} holds no *.safetensors weights")
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    st.get_tensor(name)  # reads the tensor: a truncated file fails here if not on open
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise ValueError(f"export: {f} is not a whole safetensors file ({str(e).splitlines()[0][:200]})") \
                from None
