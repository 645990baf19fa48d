"""MASA: the method, its stages and its G/B search."""
