"""The scenario space: each area's dimensions and constraints, and the covering arrays that
generate its profiles (DESIGN.md, "The scenario space")."""
