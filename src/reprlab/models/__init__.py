"""Model loading and small models trained from scratch."""
