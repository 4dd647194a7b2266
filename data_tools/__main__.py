"""`python -m data_tools ...`: the data command line (see `data_tools.cli`), without torch."""

import sys

from data_tools.cli import main

sys.exit(main())
