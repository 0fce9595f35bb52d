import sys

from clover.cli import main

sys.exit(main())
