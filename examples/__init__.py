"""Agent code a user writes anyway (``env.agent: examples.math_agent:solve``)."""
