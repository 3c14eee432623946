"""Rank-side task functions, one module per area: they run inside rank services."""
