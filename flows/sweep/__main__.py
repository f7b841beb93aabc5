import sys

from flows.sweep.cli import main

sys.exit(main())
