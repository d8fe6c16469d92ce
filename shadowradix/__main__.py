import sys

from shadowradix.cli import main

sys.exit(main())
