"""smcd: a userspace Shared Memory Communications (SMC-R, SMC-D) daemon."""

__version__ = "0.1.0"
