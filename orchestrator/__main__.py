import sys

from orchestrator.ops.cli import main

sys.exit(main())
