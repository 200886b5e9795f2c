"""Tests of aionvme.integrations against the real frameworks (each skipped without its package)."""
