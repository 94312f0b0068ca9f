"""Empty test stand-in (see qi21_test_standin.py); never part of the pack."""
import sys

import qi21_test_standin

qi21_test_standin.install(sys.modules[__name__])
