"""smc-run's bootstrap directory: put on ``PYTHONPATH`` so its ``sitecustomize`` runs first."""
