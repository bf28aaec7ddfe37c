"""EAGLE drafter training: packing, the loss, the train step and drafter files."""
