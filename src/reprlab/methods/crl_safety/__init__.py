"""CRL safety: contrastive representation learning defence, its baselines, attacks and judges."""
