import sys

from dtlab.app.cli import main

sys.exit(main())
