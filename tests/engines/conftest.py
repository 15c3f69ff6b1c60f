"""Make the shared fakes importable however pytest is invoked (plain ``pytest`` or ``-m``)."""

import pathlib
import sys

_HERE = str(pathlib.Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
