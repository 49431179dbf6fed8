"""`python -m gpubook` is the `gpubook` command."""

import sys

from gpubook.scheduler.commands.cli import main

sys.exit(main())
