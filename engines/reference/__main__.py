"""``python -m engines.reference [serve flags]`` runs the engine; ``... init-model DIR`` writes a tiny model."""

import sys

if len(sys.argv) > 1 and sys.argv[1] == "init-model":
    from .model_init import main

    raise SystemExit(main(sys.argv[2:]))

from .server import main

raise SystemExit(main(sys.argv[1:]))
