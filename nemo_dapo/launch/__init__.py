"""Production launch: capacity planning, metric plots (and the cluster launchers)."""
