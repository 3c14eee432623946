"""The suite's version, in a module of its own: the reports read it without importing the package
root (whose `check_model` reaches up to the front ends)."""

__version__ = "0.2.0"
