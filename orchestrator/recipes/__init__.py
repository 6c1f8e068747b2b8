"""Recipes built from the same actors as `fleetrl train`: supervised fine-tuning (`sft`), rejection-sampling
fine-tuning (`rft`), distillation (`distill`), DPO data, cold-start data, and multi-stage pipelines (`pipeline`)."""


def trainer_for(cfg) -> type:
    """The loop for the configured objective: policy gradients (:class:`orchestrator.trainer.Trainer`), DPO,
    a Bradley-Terry reward model or SFT."""
    if cfg.algorithm.objective == "dpo":
        from orchestrator.recipes.dpo import DPOTrainer

        return DPOTrainer
    if cfg.algorithm.objective == "bradley_terry":
        from orchestrator.recipes.preference_model import RewardModelTrainer

        return RewardModelTrainer
    if cfg.algorithm.objective == "sft":
        from orchestrator.recipes.sft import SFTTrainer

        return SFTTrainer
    from orchestrator.trainer import Trainer

    return Trainer
