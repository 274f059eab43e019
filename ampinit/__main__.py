import sys

from ampinit.cli import main

sys.exit(main())
