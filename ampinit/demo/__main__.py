import sys

from ampinit.demo.cli import main

sys.exit(main())
