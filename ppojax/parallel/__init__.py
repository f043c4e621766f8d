"""Meshes, logical-axis rule tables, placement and multi-host start-up (no algorithm code)."""
