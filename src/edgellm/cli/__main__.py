import sys

from edgellm.cli import main

sys.exit(main())
