"""The top floor: the commands (`fleetrl ...`, :mod:`orchestrator.cli.main`) and Ray jobs
(:mod:`orchestrator.cli.jobs`)."""
