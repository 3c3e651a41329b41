"""adapters layer (see README: Architecture)."""
