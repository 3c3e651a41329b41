"""smc_handoff: the application side of smcd (standard library only)."""
