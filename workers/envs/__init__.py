"""Multi-turn episodes (agentic RL): the environment API, tools, renderers and the episode loop. No vLLM or Ray
here: the rollout actor drives episodes through :mod:`workers.engine_loop`."""

from workers.envs import tool_env  # noqa: F401  (registers the stock environments by name)
