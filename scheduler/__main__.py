import sys

from llmbus.scheduler.process import main

sys.exit(main())
