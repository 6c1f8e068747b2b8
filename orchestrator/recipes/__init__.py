"""Recipes built from the same actors as `fleetrl train`: supervised fine-tuning (`sft`), rejection-sampling
fine-tuning (`rft`), distillation (`distill`), DPO data, cold-start data, and multi-stage pipelines (`pipeline`)."""
