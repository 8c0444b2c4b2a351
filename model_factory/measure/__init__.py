"""Measurement the product ships: the Triton client helpers and the ``bench`` load generator."""
