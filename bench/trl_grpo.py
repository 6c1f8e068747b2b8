"""TRL's GRPOTrainer on fleetrl's arithmetic task: the baseline of the end-to-end and learning-speed benchmarks.

    python -m bench.trl_grpo --model PATH --prompts-per-step 16 --group-size 8 --max-tokens 8 --lr 3e-5 \\
        --steps 30 [--time-budget S] [--eval-every N] --out report.json --run-dir runs/bench/trl-x

Settings mirror a fleetrl GRPO run: the same prompts in the same order (step ``s`` trains on
``ArithmeticTask().train_batch(s, P)``, as fleetrl does), G samples each, the same completion cap, sampling
(temperature, top-p 1, no top-k), learning rate (constant, no warmup, AdamW betas 0.9/0.999, no weight decay,
grad-norm clip 1), one optimizer step per batch, ``epochs`` passes (``num_iterations``), clip 0.2, no KL
(``beta=0``, as fleetrl's default ``kl_coef=0``), group-std-normalized advantages, token-level loss ("dapo",
fleetrl's ``token_mean``), fp32, no gradient checkpointing, the ``math`` reward. TRL generates with
transformers ``generate`` (its vLLM modes need a GPU); it runs in one process with ``--threads`` torch threads.

Held-out eval (``--eval-every N`` steps and at step 0): the model in ``eval()`` mode, greedy ``generate`` on the
400 prompts of ``ArithmeticTask().eval_set(400)``, scored with ``rewards.functions.math_reward``. Eval time is
excluded from the training clock. Writes a JSON report: per-step seconds, evals against training seconds,
and TRL's own logs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts-per-step", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--steps", type=int, required=True, help="maximum optimizer steps")
    ap.add_argument("--time-budget", type=float, default=None, help="stop after this many training seconds")
    ap.add_argument("--eval-every", type=int, default=0, help="greedy held-out eval every N steps (0: none)")
    ap.add_argument("--eval-size", type=int, default=400)
    ap.add_argument("--save-steps", type=int, nargs="*", default=[],
                    help="save the policy (model + tokenizer) to <run-dir>/step-N after these steps (time excluded "
                         "from the training clock)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bf16", action="store_true", help="TRL's mixed precision (bf16=True)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chat", action="store_true",
                    help="chat prompts: the task in words (prompt_style text) as a user message; TRL applies the "
                         "model's chat template, as fleetrl's data.prompt_format=chat does")
    ap.add_argument("--max-operand", type=int, default=99, help="the arithmetic task's data.max_operand")
    ap.add_argument("--out", required=True)
    ap.add_argument("--run-dir", required=True)
    args = ap.parse_args(argv)
    if args.chat and args.eval_every:
        ap.error("--chat runs time steps only: its greedy eval would skip the chat template (use --eval-every 0)")
    for key in ("prompts_per_step", "group_size", "max_tokens", "steps", "threads", "eval_size", "epochs"):
        if getattr(args, key) < 1:
            ap.error(f"--{key.replace('_', '-')} must be >= 1 (got {getattr(args, key)})")
    return args


def build_dataset(steps: int, prompts_per_step: int, seed: int, chat: bool = False, max_operand: int = 99):
    """Rows in fleetrl's prompt order: step s's prompts are ``train_batch(s, P)`` (a user message with --chat)."""
    from datasets import Dataset

    from rewards.tasks import ArithmeticTask

    task = ArithmeticTask(max_operand=max_operand, seed=seed, prompt_style="text" if chat else "compact")
    rows = [{"prompt": [{"role": "user", "content": p.text}] if chat else p.text, "answer": p.metadata["answer"]}
            for s in range(steps) for p in task.train_batch(s, prompts_per_step)]
    return Dataset.from_list(rows)


def math_rewards(prompts: list, completions: list, answer: list[str], **_) -> list[float]:
    """fleetrl's ``math`` reward in TRL's reward-function signature (extra dataset columns come as kwargs;
    conversational completions are lists of messages)."""
    from rewards.functions import math_reward

    def text(x) -> str:
        return x if isinstance(x, str) else x[-1]["content"]

    return [math_reward(text(p), text(c), {"answer": a}) for p, c, a in zip(prompts, completions, answer)]


def greedy_accuracy(model, tok, eval_prompts, max_new_tokens: int) -> float:
    """Held-out greedy accuracy with the model in eval() mode (restored to train() after)."""
    import torch

    from rewards.functions import math_reward

    was_training = model.training
    model.eval()
    enc = tok([p.text for p in eval_prompts], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id)
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    model.train(was_training)
    return sum(math_reward(p.text, t, p.metadata) for p, t in zip(eval_prompts, texts)) / len(eval_prompts)


def make_callback(args, tok, eval_prompts):
    """A TrainerCallback timing every step (eval excluded), running the evals, stopping at the time budget."""
    from transformers import TrainerCallback

    class BenchCallback(TrainerCallback):
        def __init__(self):
            self.steps, self.evals, self.logs, self.saves = [], [], [], []
            self.eval_s = 0.0
            self.generate_s = 0.0  # this step's generation and scoring (see time_generation)

        def train_s(self) -> float:
            return time.perf_counter() - self.t0 - self.eval_s

        def evaluate(self, model, step: int) -> None:
            train_s, t = self.train_s(), time.perf_counter()
            acc = greedy_accuracy(model, tok, eval_prompts, args.max_tokens)
            seconds = time.perf_counter() - t
            self.evals.append({"step": step, "train_s": train_s, "accuracy": acc, "eval_s": seconds})
            self.eval_s += seconds
            print(f"eval step {step} train_s {self.evals[-1]['train_s']:.1f} accuracy {acc:.3f}", flush=True)

        def save(self, model, step: int) -> None:
            t = time.perf_counter()
            out = os.path.join(args.run_dir, f"step-{step}")
            model.save_pretrained(out)
            tok.save_pretrained(out)
            self.saves.append({"step": step, "train_s": self.train_s(), "path": out})
            self.eval_s += time.perf_counter() - t
            self.last = self.train_s()

        def on_train_begin(self, targs, state, control, model=None, **kw):
            self.t0 = time.perf_counter()
            self.last = 0.0
            if args.eval_every:
                self.evaluate(model, 0)

        def on_step_end(self, targs, state, control, model=None, **kw):
            now = self.train_s()
            self.steps.append({"step": state.global_step, "step_s": now - self.last, "train_s": now,
                               "generate_s": self.generate_s, "learner_s": now - self.last - self.generate_s})
            self.last, self.generate_s = now, 0.0
            if args.eval_every and state.global_step % args.eval_every == 0:
                self.evaluate(model, state.global_step)
                self.last = self.train_s()
            if state.global_step in args.save_steps:
                self.save(model, state.global_step)
            if args.time_budget is not None and now > args.time_budget:
                control.should_training_stop = True

        def on_log(self, targs, state, control, logs=None, **kw):
            self.logs.append({"step": state.global_step, **(logs or {})})

    return BenchCallback()


def time_generation(trainer, callback) -> None:
    """Add the time of TRL's generation and scoring to ``callback.generate_s``, so a step splits into generation
    and the update (``learner_s`` = the step minus it: TRL's old-logprob pass, when it runs one, counts as update)."""
    inner = trainer._generate_and_score_completions

    def timed(*a, **kw):
        t = time.perf_counter()
        try:
            return inner(*a, **kw)
        finally:
            callback.generate_s += time.perf_counter() - t

    trainer._generate_and_score_completions = timed


def grpo_config(args):
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=args.run_dir, per_device_train_batch_size=args.prompts_per_step * args.group_size,
        gradient_accumulation_steps=1, num_generations=args.group_size, max_completion_length=args.max_tokens,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9,
        adam_beta2=0.999, max_grad_norm=1.0, num_iterations=args.epochs, beta=0.0, epsilon=0.2,
        temperature=args.temperature, top_p=1.0, top_k=0, loss_type="dapo", scale_rewards="group",
        max_steps=args.steps, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, bf16=args.bf16,
        fp16=False, seed=args.seed, data_seed=args.seed, shuffle_dataset=False, gradient_checkpointing=False,
        disable_dropout=True, dataloader_num_workers=0, log_completions=False, remove_unused_columns=False,
        disable_tqdm=True,
    )


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    from rewards.tasks import ArithmeticTask

    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    eval_prompts = ArithmeticTask().eval_set(args.eval_size)
    callback = make_callback(args, tok, eval_prompts)
    trainer = GRPOTrainer(model=model, reward_funcs=math_rewards, args=grpo_config(args),
                          train_dataset=build_dataset(args.steps, args.prompts_per_step, args.seed, args.chat,
                                                      args.max_operand),
                          processing_class=tok, callbacks=[callback])
    time_generation(trainer, callback)
    trainer.train()
    if args.eval_every and (not callback.evals or callback.evals[-1]["step"] != trainer.state.global_step):
        callback.evaluate(trainer.model, trainer.state.global_step)
    import resource

    report = {"settings": vars(args), "steps": callback.steps, "evals": callback.evals, "logs": callback.logs,
              "saves": callback.saves,
              "trl_version": __import__("trl").__version__, "torch_threads": torch.get_num_threads(),
              "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"trl_grpo: {len(callback.steps)} steps, report {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
