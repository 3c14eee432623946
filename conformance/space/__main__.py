"""`python -m conformance.space [profile ...]`: regenerate the stored covering arrays."""

import sys

from conformance.catalogue import bucketer as bucketer_catalogue
from conformance.catalogue import data_parallel as data_parallel_catalogue
from conformance.catalogue import ddp as ddp_catalogue
from conformance.catalogue import sharded as sharded_catalogue
from conformance.space.profiles import write_store

profiles = sys.argv[1:] or ("quick", "standard")
write_store("ddp", ddp_catalogue.handwritten(), profiles)
write_store("sharded", sharded_catalogue.handwritten(), profiles)
write_store("bucketer", bucketer_catalogue.handwritten(), profiles)
write_store("data_parallel", data_parallel_catalogue.handwritten(), profiles)
