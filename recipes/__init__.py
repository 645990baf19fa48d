"""Per-model recipes (YAML) and their schema."""
