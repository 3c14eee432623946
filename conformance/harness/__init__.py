"""Harness: warm rank services, the pool that drives them, and launchers (spawn, torchrun)."""
