"""``python -m hookloop ...``: the ``hookloop`` command, where its console script is not on
the ``PATH`` (``python -m hookloop run --nproc 2 train.py``)."""

import sys

from hookloop.cli import main

if __name__ == "__main__":
    sys.exit(main())
