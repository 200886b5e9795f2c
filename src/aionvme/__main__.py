import sys

from aionvme.cli import main

sys.exit(main())
