"""Reward functions, reward actors, tasks and datasets. ``REWARD_FUNCTIONS`` holds every built-in by name."""

from rewards.functions import REWARD_FUNCTIONS, load_builtins, load_reward_function, register_reward

load_builtins()

__all__ = ["REWARD_FUNCTIONS", "load_reward_function", "register_reward"]
