"""A small end-to-end recipe that exercises the shared core (data → training → checkpoints → resume → report)."""
