"""Contract constants, provenance, configuration, backend registry and the weight fingerprint."""
