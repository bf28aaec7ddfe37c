"""EAGLE drafter training: the loss, the train step and drafter files."""
