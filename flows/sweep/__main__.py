import sys

from flows.sweep.flow import main

sys.exit(main())
