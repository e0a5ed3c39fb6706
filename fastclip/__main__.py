import sys

from fastclip.cli import main

sys.exit(main())
