"""python -m layerline.server --plan PLAN.json | --first tcp://HOST:PORT [--checkpoint DIR] ..."""
import sys

from .cli import main

sys.exit(main())
