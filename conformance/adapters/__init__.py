"""Adapters: how an implementation under test is plugged into the suite."""
