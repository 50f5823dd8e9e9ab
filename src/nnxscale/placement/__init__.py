"""Placement: meshes, rule sets, the layout they resolve to, sharded initialisation."""
