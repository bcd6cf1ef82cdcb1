import sys

from .drift import main

sys.exit(main())
