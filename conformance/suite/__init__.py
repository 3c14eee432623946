"""The conformance test modules, parametrized from the catalogue by conformance.frontends.plugin.

Run them with `gradparity run` or `pytest --pyargs conformance.suite --adapter NAME`.
"""
