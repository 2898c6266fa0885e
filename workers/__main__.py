import sys

from llmbus.workers.group import main

sys.exit(main())
