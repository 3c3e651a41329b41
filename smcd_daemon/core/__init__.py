"""core layer (see README: Architecture)."""
