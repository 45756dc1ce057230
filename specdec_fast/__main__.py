import os
import sys

from .cli import main

code = main()
if "WORLD_SIZE" in os.environ:  # a rank that a launcher started (`parallel.in_ranks`)
    from .parallel import end_rank

    end_rank(code)
sys.exit(code)
