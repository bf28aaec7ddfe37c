"""Several processes as one run: the coordination service's key-value store as a control
plane (kv_store, control) and the host-side collectives the RL step needs (collectives)."""
