"""protocol layer (see README: Architecture)."""
