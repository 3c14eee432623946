"""`python -m conformance.space [profile ...]`: regenerate the stored covering arrays."""

import sys

from conformance.catalogue import ddp as ddp_catalogue
from conformance.space.profiles import write_store

write_store("ddp", ddp_catalogue.handwritten(), sys.argv[1:] or ("quick", "standard"))
