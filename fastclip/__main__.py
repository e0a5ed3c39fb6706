import sys

from fastclip.cli import main
from fastclip.train.preemption import process_ends_with_run

process_ends_with_run()  # this process exits when its command ends: a run's stop signals stay ignored after it
sys.exit(main())
