"""The run config's own sections (model, data, rollout, reward, learner, trainer, run, RFT, SFT, distill) and the
embedded models' paths; :class:`orchestrator.config.FleetConfig` puts them together with the algorithm, LoRA,
environment, search, PRM and Constitutional AI sections."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from orchestrator.config.lora import LoraSection
from orchestrator.config.section import Section

EMBEDDED_MODEL_PATH = ".fleetrl/models/arith-base"
CALC_MODEL_PATH = ".fleetrl/models/calc-base"
"""The embedded calculator model (the tool task, ``configs/tool_calc.yaml``), built on first use like the default."""
THINK_MODEL_PATH = ".fleetrl/models/arith-think-base"
"""The R1 recipes' embedded base: the default warm start with ``<think>``/``</think>`` tokens in its vocabulary."""
CHAIN_MODEL_PATH = ".fleetrl/models/chain-base"
"""The step model (the ``chain`` task: process supervision, PRMs, search; ``configs/chain.yaml``)."""
EMBEDDED_MODELS = {EMBEDDED_MODEL_PATH: "arith", CALC_MODEL_PATH: "calc", THINK_MODEL_PATH: "think",
                   CHAIN_MODEL_PATH: "chain"}
"""Embedded model directory -> its kind (``fleetrl init-model --kind``)."""


class ModelConfig(Section):
    path: str = EMBEDDED_MODEL_PATH
    """A local HF model directory (config, safetensors, tokenizer) or a Hugging Face Hub id `org/name` (resolved
    through the Hub cache at load, honouring `HF_HOME`, `HF_HUB_OFFLINE` and `HF_TOKEN`, and rewritten to the
    snapshot directory; `source` records the id and commit). The default is the embedded arithmetic model, built
    by `fleetrl init-model` when missing."""
    revision: str = "main"
    """The Hub revision (branch, tag or commit) of a Hub id in `path` (ignored for a local directory). Other keys
    that take a model (`distill.teacher`, `reward.model.path`, `prm.path`, `prm.orm_path`, `eval --checkpoint`)
    take a Hub id too, at its `main`."""
    source: str | None = None
    """Filled in at load: `org/name@commit` when `path` was a Hub id (recorded in config.yaml and summary.json);
    None for a local directory."""
    trust_remote_code: bool = False
    """Let transformers and vLLM run the model repo's own Python code (models whose architecture is not built in);
    only for repos you trust."""
    attn_implementation: str | None = None
    """transformers' attention implementation for the learner (`eager`, `sdpa`, `flash_attention_2`, ...); None:
    transformers' default. vLLM picks its own attention backend."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype of the learner and the rollout engines."""
    init_seed: int = 0
    """Seed of the embedded model's initialization and warm start (ignored for other models)."""


class DataConfig(Section):
    task: Literal["arithmetic", "countdown", "multi", "multiply", "chain", "tool_choice", "constitution"] = \
        "arithmetic"
    """Built-in prompt generator (used when `path` is not set): `arithmetic` (`a+b=`, reward `math`),
    `countdown` (TinyZero Countdown, reward `countdown`), `multi` (two-operation arithmetic for multi-reward
    GDPO: `math` + `format` + `length`), `multiply` (3-digit by 2-digit products: the tool task for multi-turn
    `env` episodes with the calculator), `chain` (chained addition written as running totals, one step each: the
    step task of process supervision and search, docs/search.md), `tool_choice` (a multiplication or a letter count,
    half each: the chat-model task where the policy chooses between the `calculator` and `python` tools,
    docs/agents.md), `constitution` (chat prompts whose principles are checked by rule: one sentence, a secret
    word kept, numbers in words; Constitutional AI, docs/cai.md). See the README, "Rewards, tasks and datasets"."""
    path: str | None = None
    """A dataset to train on instead of the built-in task: a file (JSONL, one JSON object per line; `.json`,
    `.parquet` or `.csv`), a local dataset directory (a Hub dataset repo's layout, or `Dataset.save_to_disk`'s),
    or a Hub dataset id `org/name` (resolved through the Hub cache at load, like `model.path`). Prompt-only rows
    in TRL's standard (`prompt` a string) or conversational (`prompt` a message list) format."""
    config: str | None = None
    """The dataset configuration (subset) of a dataset directory or Hub id in `path` (GSM8K: `main`)."""
    split: str = "train"
    """The split of a dataset directory or Hub id in `path` that is trained on."""
    eval_split: str | None = None
    """A split of the same dataset held out for evals (e.g. `test`); default: the last `eval_size` rows of
    `split`. Give this or `eval_path`, not both."""
    source: str | None = None
    """Filled in at load: `org/name@commit` when `path` was a Hub dataset id; None otherwise."""
    prompt_field: str = "prompt"
    """Dataset column holding the prompt (GSM8K: `question`): a string, or a list of chat messages
    (`[{role, content}, ...]`)."""
    prompt_format: Literal["auto", "chat", "raw"] = "auto"
    """How a prompt becomes the engine's tokens. `chat`: the tokenizer's chat template
    (`apply_chat_template(..., add_generation_prompt=True)`), with `system_prompt` first when set; `raw`: the
    text tokenized as is; `auto`: `chat` when the tokenizer has a chat template, else `raw`."""
    system_prompt: str | None = None
    """System message put before every prompt in `chat` format (a prompt given as messages that has its own
    system message keeps it)."""
    answer_field: str = "answer"
    """Dataset column holding the reference answer (`#### n` endings, as in GSM8K, keep `n`)."""
    eval_path: str | None = None
    """Held-out JSONL or Parquet file for evals; default: the last `eval_size` rows of `path`, never trained on."""
    skip_invalid: bool = False
    """Skip and count malformed dataset rows instead of failing with file and line."""
    verifier: str = "math"
    """Datasets (`path`): a registered reward function name or `pkg.module:fn` used to decide correctness for
    accuracy metrics (`eval/accuracy`, `train/accuracy`, `fleetrl eval`); a completion is correct when it scores
    >= 1.0 (a dict: every component). Built-in tasks name their own (`countdown`: `countdown`, else `math`)."""
    answer_form: Literal["auto", "number", "expression"] = "auto"
    """Datasets (`path`): the form of a final answer (the `math` verifier, docs/rewards_and_tasks.md, "The final
    answer"): `number` needs one numeral (`159`, `3/4`, `0.75`; an unevaluated `64 + 95` is wrong), `expression`
    compares by math-verify's equivalence, `auto` picks `number` for a numeric reference and `expression` else."""
    prompts_per_step: int = Field(16, ge=1, le=4096)
    """Distinct prompts per training step; each gets `rollout.group_size` samples."""
    eval_size: int = Field(400, ge=1, le=100000)
    """Number of held-out prompts scored greedily at each eval."""
    max_prompt_tokens: int = Field(512, ge=1)
    """Prompts longer than this many tokens are rejected (the engine context is this plus max_new_tokens)."""
    max_operand: int = Field(99, ge=1, le=10**6)
    """Built-in tasks: operands are drawn from [0, max_operand] (`countdown`: its numbers from [1, max_operand])."""
    prompt_style: Literal["auto", "text", "compact"] = "auto"
    """Built-in tasks: `text` states the problem and instructions in words (for real chat models); `compact`
    writes the bare problem in the embedded model's character vocabulary (`0-9 + - * ( ) =`, e.g. `12+30=`).
    `auto`: `compact` for `arithmetic` (the embedded default run), `text` for `countdown` and `multi`."""
    countdown_min_numbers: int = Field(3, ge=2, le=8)
    """`countdown`: fewest numbers given in a problem."""
    countdown_max_numbers: int = Field(4, ge=2, le=8)
    """`countdown`: most numbers given in a problem."""
    countdown_max_target: int = Field(100, ge=1, le=10**6)
    """`countdown`: targets are integers in [1, countdown_max_target]."""
    chain_terms: int = Field(4, ge=2, le=8)
    """`chain`: numbers added per problem (the solution has one step fewer)."""
    step_separator: str | None = None
    """The text that ends a step of a solution (process rewards, PRM labels and scores, step-level search); default:
    the task's (`chain` compact: `;`, else a newline)."""
    seed: int = 0
    """Seed of the prompt stream (the eval split is fixed and does not depend on it)."""

    @field_validator("verifier")
    @classmethod
    def _check_verifier(cls, name: str) -> str:
        from rewards.functions import is_batched, load_reward_function

        try:
            fn = load_reward_function(name)
        except KeyError as e:
            raise ValueError(e.args[0]) from None
        except ImportError as e:
            raise ValueError(f"cannot import the verifier {name!r}: {e}") from None
        if is_batched(fn):
            raise ValueError(f"{name!r} has TRL's batched signature; a verifier decides one completion at a time "
                             "(evals, RFT and search call it per sample): give fn(prompt, completion, metadata), "
                             "e.g. math")
        return name

    @model_validator(mode="after")
    def _check_countdown_range(self) -> DataConfig:
        if self.countdown_min_numbers > self.countdown_max_numbers:
            raise ValueError(f"data.countdown_min_numbers ({self.countdown_min_numbers}) must not exceed "
                             f"data.countdown_max_numbers ({self.countdown_max_numbers})")
        if self.eval_split and self.eval_path:
            raise ValueError(f"data.eval_split ({self.eval_split!r}) and data.eval_path ({self.eval_path!r}) both "
                             "name the eval rows: give one")
        return self

    chat_template: str | None = None
    """A chat template replacing the tokenizer's (a Jinja file's path, or the template text itself): what `chat`
    format renders prompts, episodes and SFT/DPO rows with, on the engines and in the driver. None: the
    tokenizer's own."""
    chat_template_kwargs: dict = {}
    """Extra variables for the chat template (e.g. `{enable_thinking: false}` for Qwen3's), passed to
    `apply_chat_template` wherever a prompt or row is rendered (training, evals, search, length filtering, SFT and
    DPO rows); not yet to multi-turn episodes (`env`), which render with the template alone."""

    @field_validator("chat_template")
    @classmethod
    def _check_chat_template(cls, value: str | None) -> str | None:
        from workers.prompts import read_chat_template

        if value is not None:
            read_chat_template(value)  # a missing file is refused at load, not on the engines
        return value


class RolloutConfig(Section):
    num_workers: int = Field(2, ge=1, le=1024)
    """Number of `rollout-i` actors, each owning one vLLM engine."""
    group_size: int = Field(8, ge=1, le=1024)
    """G: samples per prompt."""
    max_new_tokens: int = Field(8, ge=1, le=131072)
    """Completion length cap."""
    temperature: float = Field(1.0, gt=0.0, le=10.0)
    """Sampling temperature for training rollouts (eval is greedy)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling for training rollouts."""
    kv_cache_gib: float = Field(0.25, gt=0.0, le=1024)
    """CPU: VLLM_CPU_KVCACHE_SPACE per engine, GiB. GPU: ignored (see gpu_memory_utilization)."""
    gpu_memory_utilization: float = Field(0.5, gt=0.0, le=1.0)
    """GPU only: fraction of GPU memory the engine may take."""
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    """GPU only: tensor parallel degree of each engine."""
    num_cpus: float = Field(0.5, ge=0.0)
    """Ray CPUs reserved by each rollout actor."""
    cpu_threads: int | None = Field(None, ge=1, le=1024)
    """CPU engines: torch threads of each. Unset: in `sync` mode, when the engines generate alone, the cores of
    the machine the run is launched from shared among `num_workers` engines (one engine on 2 cores: 2 threads,
    1.7x the tokens/s of 1 thread with SmolLM2-135M on an AVX2 EPYC); 1 in `one_step_off` mode, where they generate
    while the learner trains, and on GPU engines."""
    num_gpus: float = Field(0.0, ge=0.0)
    """Ray GPUs reserved by each rollout actor."""
    weight_bucket_mb: float = Field(256.0, gt=0.0)
    """Weights are pushed to the engines in buckets of at most this many MB."""
    weight_sync: Literal["object_store", "collective"] = "object_store"
    """How the learner's weights reach the engines. `object_store`: packed buckets through Ray's object store
    (works across restarts and resizes as is). `collective`: learner rank 0 broadcasts the buckets into every engine
    worker over one extra process group (NCCL on GPU, gloo on CPU; `workers/nccl_sync.py`), rebuilt after a
    restart or resize. On this 2-core CPU machine the object store is the faster (see README)."""
    weight_sync_timeout_s: float = Field(300.0, gt=0.0, le=86400.0)
    """`collective`: the longest any call of the weight group may wait (its rendezvous, a bucket's broadcast), so a
    push whose peer died or stalls mid-broadcast fails within this instead of hanging (gloo; NCCL's communicator
    has no timeout). The object-store push fails at once when an engine dies."""
    seed: int = 0
    """Base sampling seed; sample seeds derive from it, the step and the prompt index."""
    max_restarts: int = Field(3, ge=0)
    """Rollout actors that die are replaced (with the current weights) and their prompts re-run, this many
    times per run."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: set aside groups whose rewards are all equal and sample more prompts until the
    step's batch is full of informative groups (or `max_sampling_rounds` is reached)."""
    max_sampling_rounds: int = Field(3, ge=1, le=100)
    """Cap on generate+score rounds per step with dynamic sampling."""
    mode: Literal["sync", "one_step_off", "async"] = "sync"
    """`sync`: generate, then train, then push. `one_step_off`: the engines generate (and the reward actors
    score) batch k+1 with policy version k while the learner trains on batch k; samples are one version stale
    and the truncated-IS correction (`algorithm.tis_cap`) weighs them. `async`: the engines generate without
    pause from the prompt stream (at most `max_staleness` versions of work admitted ahead of the learner), the
    learner takes a batch as soon as `data.prompts_per_step` groups are complete and scored, and a weight push
    lands between two engine steps: unfinished samples keep their tokens and continue with the new weights
    (partial rollouts; each token's version is recorded). With `max_staleness: 0` it trains exactly as `sync`.
    Every loop that samples runs in every mode (RL and on-policy distillation, online DPO, RFT); whether its
    objective may train on an older policy's samples is the algorithm's to say (policy gradients need
    `algorithm.tis_cap`; DPO and RFT's SFT do not weigh samples by the sampling policy)."""
    source: str | None = None
    """Your own rollout source instead of `mode`'s: `module:Class`, a subclass of
    `orchestrator.rl.rollout_source.RolloutSource` (its `take(step, timer)` returns the step's scored groups)."""
    max_staleness: int = Field(1, ge=0, le=16)
    """Largest allowed `policy_version` gap between a token's generator and the learner that trains on it
    (one_step_off needs >= 1; a larger gap stops the run). `async`: the admission bound too, and a group with an
    older token is handled by `stale_policy`."""
    stale_policy: Literal["drop", "wait"] = "drop"
    """`async`. `drop`: the learner takes the first complete groups, and one with a token more than
    `max_staleness` versions old is dropped (counted in `async/dropped_stale`, its prompt's slot given back to the
    stream). `wait`: the learner takes the groups in the order they were admitted, waiting for the oldest
    (`async/waited_s`); the admission bound then keeps every token within `max_staleness` and nothing is
    dropped."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources each rollout actor requests (e.g. `{rollout_gpu: 1}`), beside num_cpus/num_gpus."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Engine dtype; `auto` = model.dtype. A lower precision than the learner's (bf16 engines, fp32 learner)
    generates faster; the learner's own first-pass logprobs are the old logprobs and the truncated IS
    (`algorithm.tis_cap`) corrects for the engine/learner gap."""
    max_logprob_gap: float | None = Field(0.5, gt=0.0)
    """Before step 0 the mismatch doctor (`orchestrator/rl/doctor.py`, also `fleetrl doctor -c ...`) samples a
    small batch and compares the engines' logprobs of its tokens with the learner's; a run whose p99 |gap| (nats)
    is above this is refused, the message naming the cause (a corrupted push, the sampling temperature or top-p,
    the engines' dtype) and the fix. None: no check. Measured p99 with SmolLM2-135M: fp32 3e-5, bf16 engines and
    autocast learner 0.25; a learner at T=1 scoring T=0.7 samples 1.25."""
    stop: list[str] = Field(default_factory=list)
    """Stop strings: generation also ends where the text produces one of these (the string is kept in the
    completion and trained on). Generation always stops at the model's EOS / end-of-turn tokens (its
    generation_config), and that token is part of the trained response."""
    enforce_eager: bool | None = None
    """vLLM eager mode. None: eager on CPU (fast start; a compiled graph takes ~40-90 s per engine to build on a
    2-core x86 CPU and pays off only on larger models), compiled/CUDA graphs on GPU. false: torch.compile on CPU too."""


class RewardFunctionSpec(Section):
    name: str = "math"
    """A built-in reward (see rewards.REWARD_FUNCTIONS), an import path `pkg.module:function`, or `judge`: an AI
    judge scores each response against the constitution's rubric questions (`cai` section; rewards/judge.py)."""
    weight: float = 1.0
    """Weight of this function's value in the summed reward."""
    params: dict[str, float | int | str | bool] = Field(default_factory=dict)
    """Keyword arguments bound to the function (e.g. `{max_len: 64}` for `length`; the judge's `on_error`: the
    score of a response the judge could not read, default 0)."""

    @model_validator(mode="after")
    def _binds(self) -> RewardFunctionSpec:
        """The function imports and takes ``(prompt, completion, metadata, **params)`` (the judge is checked with
        the `cai` section)."""
        from rewards.functions import bind_reward_function
        from rewards.judge import NAME

        if self.name != NAME:
            bind_reward_function(self.name, self.params)
        return self


class RewardModelConfig(Section):
    path: str | None = None
    """Local HF sequence-classification reward model (one output, `num_labels=1`); set, it starts
    `num_workers` `reward-model-i` actors and adds a `reward_model` component (its logit on prompt + completion)
    to every sample. `.fleetrl/models/arith-rm` is the embedded one, built from the policy when missing."""
    num_workers: int = Field(1, ge=1, le=1024)
    """Number of `reward-model-i` actors (used only when `path` is set)."""
    batch_size: int = Field(64, ge=1, le=65536)
    """(prompt, completion) pairs per reward-model forward pass."""
    weight: float = Field(1.0, ge=-1e6, le=1e6)
    """Weight of the `reward_model` component in the summed reward (0 logs it without training on it)."""
    num_cpus: float = Field(0.25, ge=0.0)
    """Ray CPUs reserved by each reward-model actor."""


class RewardConfig(Section):
    num_workers: int = Field(1, ge=1, le=1024)
    """Number of `reward-i` actors."""
    functions: list[RewardFunctionSpec] = Field(default_factory=lambda: [RewardFunctionSpec()])
    """Reward functions scored for every completion; the reward is their weighted sum."""
    timeout_s: float = Field(10.0, gt=0.0)
    """Per-call time limit of a reward function; a call past it scores 0 and counts as an error."""
    strict: bool = False
    """Make a raising or hanging reward function fatal instead of scoring 0."""
    max_error_frac: float = Field(0.5, ge=0.0, le=1.0)
    """A step where more than this share of the reward-function calls raise, time out or return no number stops
    the run with the first failure (1: never; `strict` stops at the first)."""
    processes: int = Field(2, ge=1, le=64)
    """Worker processes per reward actor that run the functions under the hard limits (rewards/bounded.py): a
    call past `timeout_s` is stopped by killing its process (`reward/timeouts`), which is replaced."""
    memory_mb: int = Field(2048, ge=256)
    """Address-space limit of each of those processes; a call past it raises MemoryError (scores 0, an error)."""
    max_restarts: int = Field(3, ge=0)
    """Reward actors that die are replaced and their batch re-scored, this many times per run."""
    num_cpus: float = Field(0.25, ge=0.0)
    """Ray CPUs reserved by each reward actor."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources each reward actor requests."""
    model: RewardModelConfig = Field(default_factory=RewardModelConfig)
    """A learned reward model scored beside the functions (off unless `reward.model.path` is set)."""


class LearnerConfig(Section):
    num_ranks: int = Field(2, ge=1, le=4096)
    """Learner ranks (`learner-i` actors) forming one torch.distributed group."""
    zero_stage: int = Field(2, ge=0, le=3)
    """DeepSpeed ZeRO stage."""
    lr: float = Field(3e-5, gt=0.0, le=1.0)
    """AdamW learning rate: the peak, after warmup (`lr_schedule`)."""
    warmup_steps: int = Field(0, ge=0)
    """Linear LR warmup, in optimizer steps."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """The LR after warmup: `constant`, or decayed to `min_lr_ratio * lr` over the run's optimizer steps
    (`trainer.total_steps * num_minibatches * epochs`) linearly (TRL's default) or on a half cosine; it stays there
    if a run takes more optimizer steps. Its state is checkpointed with the optimizer's."""
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    """`linear` and `cosine`: the LR at the end of the decay, as a fraction of `lr`."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    grad_clip: float = Field(1.0, ge=0.0)
    """Global gradient-norm clip (0 disables)."""
    micro_batch_size: int = Field(32, ge=1)
    """Sequences per forward/backward on one rank (when `micro_batch_tokens` is not set)."""
    micro_batch_tokens: int | None = Field(None, ge=1)
    """Token budget per forward/backward on one rank: consecutive samples are grouped while their real tokens
    (prompt + response) fit, so one long response no longer decides the memory of a whole micro-batch. None: a
    fixed `micro_batch_size` samples. The loss and gradients do not depend on the split."""
    packing: bool = True
    """Sequence packing: a micro-batch's samples are concatenated without padding into one row with position ids
    restarting per sample; transformers detects the restarts and keeps attention inside each sample (with SDPA, the
    default, through a block-diagonal mask whose cost is quadratic in the row length; a model loaded with
    flash-attention 2 uses its varlen kernel). false: the left|right padded layout."""
    logprob_chunk_tokens: int = Field(1024, ge=0)
    """The LM head and log-softmax run on response positions only, this many tokens at a time, recomputed in
    backward (no [tokens, vocab] fp32 tensor for the micro-batch). 0: the naive path for comparison (padded layout
    whatever `packing` says, logits over every position, full log-softmax kept for backward, entropy always)."""
    log_entropy: bool = True
    """Compute the policy entropy of the response tokens for the `entropy` metric (it is always computed when
    `algorithm.entropy_coef` > 0)."""
    num_minibatches: int = Field(1, ge=1)
    """Optimizer steps per training step (the batch is split into this many minibatches)."""
    epochs: int = Field(1, ge=1)
    """Passes over the step's batch."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward (saves memory on large models)."""
    log_kl: bool = False
    """Keep the frozen reference model and log KL(pi || pi_ref) even when no loss term uses it (one more forward
    pass per step). With `algorithm.kl_coef` > 0 (or PPO's `kl_reward_coef`) the reference is always there."""
    mixed_precision: Literal["bfloat16", "float16"] | None = None
    """None: plain model.dtype. Otherwise the learner's forward and backward compute under torch.autocast in this
    dtype (AMX / tensor-core matmuls) while parameters, gradients and optimizer state stay in model.dtype. On an
    Intel Xeon with AMX (2 cores) bf16 makes the 24 M-param update ~1.45x faster (docs/BENCHMARKS.md)."""
    logprob_pass: Literal["auto", "always"] = "auto"
    """`auto`: when the batch is used once (1 epoch, 1 minibatch, no critic), the old logprobs are the learner's
    own logprobs in the update's first pass (the weights before the update, so the PPO ratio starts at exactly 1)
    and the reference pass is fused into that pass: no separate forward pass. Engine/learner differences (a
    one_step_off batch, bf16 engines) are weighed by the truncated IS. `always`: a separate pass computes old and
    reference logprobs before the update."""
    num_cpus: float = Field(0.5, ge=0.0)
    """Ray CPUs reserved by each learner rank."""
    num_gpus: float = Field(0.0, ge=0.0)
    """Ray GPUs reserved by each learner rank."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources each learner rank requests (in its placement-group bundle)."""
    master_port: int = Field(0, ge=0, le=65535)
    """torch.distributed rendezvous port on rank 0's node (0 picks a free one)."""
    lora: LoraSection = Field(default_factory=LoraSection)
    """LoRA adapters on the policy (`rank: 0`, the default, trains the full weights; see docs/lora.md)."""


class TrainerConfig(Section):
    total_steps: int = Field(200, ge=0)
    """Training steps to run."""
    max_bad_steps: int = Field(3, ge=1)
    """Steps in a row whose update is skipped for a NaN/Inf loss or gradient before the run stops."""
    save_every: int = Field(0, ge=0)
    """Write a resumable checkpoint every this many steps (0 disables)."""
    save_every_s: float = Field(300.0, ge=0.0)
    """Also write one after the first step that ends this many seconds after the last checkpoint (or the first step),
    so a killed run can `--resume auto` (0 disables). One checkpoint of the embedded default (`make train`: 12 MB,
    2 learner ranks, ZeRO-2) takes 0.08-0.15 s against 0.4 s steps, on 2 busy cores of an Intel Xeon (family 6,
    model 167)."""
    keep_checkpoints: int = Field(2, ge=1)
    """How many complete checkpoints to keep (oldest deleted first)."""
    time_budget_s: float | None = Field(None, gt=0)
    """Stop training after this many seconds (then a final eval); None runs all `total_steps`."""
    eval_every: int = Field(25, ge=0)
    """Run a held-out eval every this many steps (and at step 0 and the last step); 0 disables evals."""
    eval_samples: int = Field(0, ge=0, le=64)
    """k > 0: each eval also samples k completions of every held-out prompt at `rollout.temperature` and logs
    `eval/pass@1` (their accuracy, averaged: pass@1 over k samples) and `eval/maj@k` (the accuracy of the
    majority-voted answer, the task's answer key) beside the greedy `eval/accuracy`; it costs k sampled
    completions per held-out prompt. 0: greedy only."""
    keep_best: str | None = None
    """An eval metric (e.g. `eval/accuracy`; higher is better): the policy of the best eval so far is kept as
    `<run.dir>/best/` (an HF model, as `final/`, with `fleetrl_best.json` naming the step and value), exported
    at each eval that improves on it (the cost of one `final/` export: `time/keep_best_s`). A pipeline stage's
    `pass: best` hands it to the next stage instead of `final/`. None: only `final/`."""
    seed: int = 0
    """Seed of the learner (torch) and driver RNGs."""
    show_samples: int = Field(2, ge=0, le=100)
    """Eval completions shown with their verdict (about half wrong, half right) on the console and as text in
    TensorBoard / W&B / MLflow at every eval; every eval's completions are in `<run.dir>/evals/step_N.jsonl`."""
    torch_threads: int = Field(1, ge=1)
    """torch intra-op threads per actor (keep small: actors share the machine's cores)."""

    @field_validator("keep_best")
    @classmethod
    def _check_keep_best(cls, key: str | None) -> str | None:
        if key is not None and not key.startswith("eval/"):
            raise ValueError(f"{key!r} is not an eval metric: give one the held-out eval logs, e.g. eval/accuracy")
        return key


class RunConfig(Section):
    dir: str = "runs/default"
    """Run directory: resolved config, metrics.jsonl, TensorBoard events, plot, final policy."""
    ray_address: str | None = None
    """Ray cluster to join; None uses RAY_ADDRESS or starts a local one."""
    seed: int | None = None
    """One seed for every part of the run: when set, it is `data.seed` (the prompt stream), `rollout.seed`
    (sampling) and `trainer.seed` (learner and driver RNGs); one of those set to another value as well is refused.
    None: each keeps its own (default 0)."""
    startup_timeout_s: float = Field(900.0, gt=0.0)
    """How long the actors may take to be placed and started; past it the run stops, naming the actors still
    waiting and the resources the cluster has free (an autoscaling cluster may need longer)."""
    plot_every: int = Field(10, ge=1)
    """Rewrite the progress plot every this many steps."""
    dump_rollouts: bool = False
    """Debug: write every step's scored samples (uid, sample index, worker, policy version, reward, text) to
    `rollouts/step_NNNNNN.jsonl` in the run directory."""
    verbose: bool = False
    """Show every actor's and engine's own output (vLLM, DeepSpeed, Ray) on the console, as well as in
    `logs/<actor>.log` (`fleetrl train --verbose`). Off: the console shows fleetrl's banner, progress, evals
    and the warnings that matter; everything else is in `logs/`."""
    loggers: list[Literal["jsonl", "tensorboard", "wandb", "mlflow"]] = ["jsonl", "tensorboard"]
    """Where step metrics go (same names everywhere; the resolved config is logged as params). `jsonl` is the
    run's own record (`metrics.jsonl`, read on resume) and is required; `wandb` and `mlflow` need the
    `trackers` extra (`pip install 'fleetrl[trackers]'`)."""
    wandb_project: str = "fleetrl"
    """W&B project of the run."""
    wandb_entity: str | None = None
    """W&B entity (user or team) the project belongs to; None: W&B's default (`WANDB_ENTITY`, else the login's)."""
    wandb_name: str | None = None
    """W&B run name; None: the run dir's name."""
    wandb_tags: list[str] = []
    """W&B tags of the run."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """`offline`: W&B writes the run under `<run.dir>/wandb/` and needs no network (`wandb sync` uploads it
    later); `online` streams to the W&B server (needs a login)."""
    mlflow_tracking_uri: str | None = None
    """MLflow tracking URI; None: `MLFLOW_TRACKING_URI` when set (a team's server), else a local SQLite store,
    `sqlite:///<run.dir>/mlflow.db` (`mlflow ui --backend-store-uri sqlite:///<run.dir>/mlflow.db`)."""
    mlflow_experiment: str = "fleetrl"
    """MLflow experiment the run is logged under."""

    @field_validator("loggers")
    @classmethod
    def _check_loggers(cls, v: list[str]) -> list[str]:
        import importlib.util

        if "jsonl" not in v:
            raise ValueError(f"{v}: must include 'jsonl' (metrics.jsonl is the run's own record: resume and the "
                             "progress plot read it)")
        if len(set(v)) != len(v):
            raise ValueError(f"{v}: a logger is listed twice")
        for name, module in (("wandb", "wandb"), ("mlflow", "mlflow")):
            if name in v and importlib.util.find_spec(module) is None:
                raise ValueError(f"'{name}' needs the {module} package, which is not installed: "
                                 "pip install 'fleetrl[trackers]'")
        return v


class RFTConfig(Section):
    """`fleetrl rft`: rejection-sampling fine-tuning (the other sections give prompts, G, learner, engines)."""

    rounds: int = Field(10, ge=1, le=100000)
    """Rounds of generate -> keep verified-correct samples -> one supervised update -> push weights."""
    threshold: float = Field(1.0, ge=-1e6, le=1e6)
    """A sample is kept when its summed reward is >= this (1.0 with the `math` reward: a correct answer)."""


class SFTSection(Section):
    """`fleetrl sft` (and the SFT of `fleetrl distill`): supervised fine-tuning on the learner group. Each step
    trains on `data.prompts_per_step * rollout.group_size` rows (the learner's batch); evals use the task's
    held-out prompts and verifier, as in RL."""

    data: str | None = None
    """The SFT rows: a file (JSONL, `.json`, `.parquet`, `.csv`), a dataset directory (its `train` split) or a Hub
    dataset id, in TRL's formats: `{"messages": [...]}` (conversational), `{"prompt", "completion"}`
    (prompt-completion: strings, or messages and the assistant's message), or `{"prompt", "response"}`. Only
    assistant tokens are trained; `fleetrl data cold-start` writes such a file for the built-in tasks."""


class DistillSection(Section):
    """The teacher of both distillations. Offline, `fleetrl distill`: the teacher generates `rollout.group_size`
    samples for each of `prompts` training prompts on the rollout actors, the task's verifier keeps the correct
    ones (rejection sampling), and the student (`model.path`) is fine-tuned on them with the `sft` settings.
    On-policy, `algorithm.name: on_policy_distill`: the student samples and `teacher_workers` engines of the
    teacher score its tokens."""

    teacher: str | None = None
    """The teacher: a local HF model directory (any size the engines can hold)."""
    prompts: int = Field(256, ge=1, le=10**7)
    """Training prompts the teacher answers (offline distillation)."""
    teacher_workers: int = Field(1, ge=1, le=1024)
    """On-policy distillation: the teacher's vLLM engines (`teacher-i` actors, `rollout`'s engine settings)."""
