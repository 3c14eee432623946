"""Shared test configuration: pytester for the plugin/CLI tests."""

pytest_plugins = ["pytester"]
