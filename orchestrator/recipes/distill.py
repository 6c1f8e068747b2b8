"""`fleetrl distill`: a teacher's verified reasoning traces -> SFT of a smaller student (DeepSeek-R1's distilled
models). On the same actors as every recipe:

    teacher engines (rollout actors loading ``distill.teacher``) generate ``rollout.group_size`` samples for each
    of ``distill.prompts`` training prompts -> the reward actors score them -> the task's verifier keeps the correct
    ones (rejection sampling, distinct completions once) -> ``<run.dir>/distill_data.jsonl`` -> the teacher's actors
    are released -> ``fleetrl sft`` of the student (``model.path``) on that file

The student re-tokenizes the teacher's text (teacher and student need not share a tokenizer). A rerun after a crash
reuses the written data and resumes the SFT from its newest checkpoint. ``<run.dir>/distill.json`` reports the
teacher's accuracy, the kept fraction and the student's held-out accuracy before and after.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from orchestrator.config import FleetConfig
from orchestrator.rl.launch import check_teacher

log = logging.getLogger("fleetrl")


def teacher_data(cfg: FleetConfig, out: Path, fleet=None) -> dict:
    """Generate with the teacher, keep the verified samples, write them as SFT rows; returns the counts. ``fleet``
    (a pipeline's): the teacher's engines run on it (it serves the student next), else on a fleet of their own."""
    from orchestrator.data import write_jsonl
    from orchestrator.loops.rft import keep_verified
    from orchestrator.rl.fleet import Fleet, Roles
    from orchestrator.rl.launch import make_task
    from rewards.functions import verdicts

    tree = cfg.model_dump()
    tree["model"]["path"] = str(check_teacher(cfg))
    tcfg = FleetConfig.model_validate(tree)
    task = make_task(tcfg)
    prompts = task.train_batch(0, cfg.distill.prompts)
    text = {p.uid: p.text for p in prompts}
    roles = Roles(rollout=True, reward=True)
    teacher = fleet.serve(tcfg, roles) if fleet is not None else Fleet.start(tcfg, roles)
    try:
        samples = teacher.rollouts.generate(prompts, cfg.rollout.group_size, cfg.rollout.temperature,
                                            seed=cfg.rollout.seed)
        scored, errors = teacher.rewards.score(samples)
    finally:
        if fleet is None:  # stopped before the student's starts
            teacher.stop()
    correct = verdicts(task.verifier_fn, [(s.prompt_text, s.completion_text, s.metadata) for s in samples])
    right = {id(x) for x, ok in zip(scored, correct) if ok}
    kept = [x for x in keep_verified(scored, cfg.rft.threshold) if id(x) in right]
    if not kept:
        raise RuntimeError(f"distill: the teacher {cfg.distill.teacher} answered none of {len(prompts)} prompts "
                           "correctly; nothing to distill")
    rows = [{"prompt": text[x.sample.prompt_uid], "response": x.sample.completion_text} for x in kept]
    write_jsonl(out, rows)
    return {"teacher": cfg.distill.teacher, "prompts": len(prompts), "samples": len(samples),
            "teacher_accuracy": sum(correct) / len(correct), "kept": len(kept),
            "kept_fraction": len(kept) / len(samples), "reward_errors": errors,
            "prompts_with_kept": len({x.sample.prompt_uid for x in kept})}


def run_distill(cfg: FleetConfig, resume: str | None = None, fleet=None) -> dict:
    from orchestrator.loops.sft import run_sft
    from orchestrator.rl.launch import init_ray

    check_teacher(cfg)
    run_dir = Path(cfg.run.dir)
    data, report_path = run_dir / "distill_data.jsonl", run_dir / "distill.json"
    report = json.loads(report_path.read_text()) if report_path.exists() and data.exists() else None
    if report is None:
        init_ray(cfg)
        report = teacher_data(cfg, data, fleet)
        report_path.write_text(json.dumps(report, indent=1))
        log.info("distill: teacher accuracy %.3f, kept %d samples (%.1f%%)", report["teacher_accuracy"],
                 report["kept"], 100 * report["kept_fraction"])
    tree = cfg.model_dump()
    tree["sft"]["data"] = str(data)
    history = run_sft(FleetConfig.model_validate(tree), resume=resume, fleet=fleet)
    evals = [m["eval/accuracy"] for m in history if "eval/accuracy" in m]
    report.update(student_accuracy_before=evals[0] if evals else None,
                  student_accuracy_after=evals[-1] if evals else None)
    report_path.write_text(json.dumps(report, indent=1))
    print(f"distill: teacher accuracy {report['teacher_accuracy']:.3f}, kept {report['kept']} of "
          f"{report['samples']} samples; student held-out accuracy {report['student_accuracy_before']} -> "
          f"{report['student_accuracy_after']}")
    return report
