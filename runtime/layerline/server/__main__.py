"""python -m layerline.server --plan PLAN.json | --first tcp://HOST:PORT [--checkpoint DIR] ..."""
import sys

from ..forkserver import hand_over

hand_over("layerline.server")   # the test suite's warm starts (LAYERLINE_FORKSERVER); else returns

from .cli import main  # noqa: E402

sys.exit(main())
