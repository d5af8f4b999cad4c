"""Lowest layer: whole-or-nothing files and progress/cancel events. Imports nothing else of the core."""
