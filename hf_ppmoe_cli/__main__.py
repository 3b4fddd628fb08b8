"""`python -m hf_ppmoe_cli COMMAND ...`: the same as `hf-ppmoe COMMAND ...`."""

import sys

from . import main

sys.exit(main())
