"""A plugin module that fails on import (tests/test_config.py: a config error, not a crash in an actor)."""

raise ZeroDivisionError("this plugin fails on import")
