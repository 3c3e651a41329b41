"""transport layer (see README: Architecture)."""
