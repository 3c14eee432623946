"""`python -m conformance.space [profile ...]`: regenerate the stored covering arrays (and the
excluded pairs stored beside standard's and full's), every area with a space, around its
hand-written scenarios."""

import sys

from conformance.catalogue import HANDWRITTEN
from conformance.space.profiles import AREAS, write_store

for area in AREAS:
    write_store(area, HANDWRITTEN[area](), sys.argv[1:] or ("quick", "standard"))
