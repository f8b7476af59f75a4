"""Frontends: turn the programs of real frameworks into partopt Graphs."""
