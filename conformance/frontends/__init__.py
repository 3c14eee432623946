"""The front ends: every way a user starts the suite, all running the one case pipeline.

- `cli`           `gradparity` (the console script): `run`, `list`, `zoo` and `compare`;;
- `plugin`        the pytest plugin (entry point `pytest11`): the suite's tests, parametrized
                  from the catalogue, and the reports;
- `zoo`           `gradparity zoo`: every known-bad implementation against the suite;
- `compare_runs`  `gradparity compare A B`: what moved between two recorded runs;
- `options`       the options the CLI and the plugin share, validated before any work starts;
- `torchrun`      the launcher for `torchrun` worlds (multi-node): rank 0 coordinates.

Each builds a plan (`conformance.plan`), runs it through `conformance.pipeline` and writes the
reports (`conformance.report`); none judges or plans on its own.
"""
