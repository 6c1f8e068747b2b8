"""Recipes: multi-stage pipelines, distillation, Constitutional AI and the data writers stages use."""
