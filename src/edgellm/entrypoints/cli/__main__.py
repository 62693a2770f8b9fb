import sys

from edgellm.entrypoints.cli import main

sys.exit(main())
