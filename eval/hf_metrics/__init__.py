"""vlrft metrics as `evaluate` metric modules: `evaluate.load("<this folder>/pass_at_k")` etc. (no hub)."""
