"""`python -m edgellm ...`: the command line, as the `edgellm` script runs it."""
import sys

from edgellm.entrypoints.cli import main

sys.exit(main())
