"""The linear_logp op: CPU oracle, SM90 kernel launcher and the public entry points."""
