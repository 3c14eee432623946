"""The oracle's inputs: the built-in models (`builtin`), data_parallel's structured models
(`data_parallel`) and deterministic data, weights and losses (`data`).

These are production code of the suite (the single-process oracle and every rank build from
them), so they live inside `conformance`, not beside the tests.
"""
