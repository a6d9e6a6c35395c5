"""python -m layerline.worker ...: the plan's OpenMP spin goes into the environment before torch loads."""
import sys

from ..forkserver import hand_over
from .cli import openmp_env

openmp_env(sys.argv[1:])
hand_over("layerline.worker")   # the test suite's warm starts (LAYERLINE_FORKSERVER); else returns

from . import serve  # noqa: E402,F401 - loads torch (libgomp reads GOMP_SPINCOUNT once, now)
from .cli import main  # noqa: E402

sys.exit(main())
