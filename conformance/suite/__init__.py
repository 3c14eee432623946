"""The conformance test modules, parametrized from the catalogue by conformance.plugin.

Run them with `gradparity run` or `pytest --pyargs conformance.suite --adapter NAME`.
"""
