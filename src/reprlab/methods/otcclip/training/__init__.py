"""Training: one trainer for every defense, in memory or streamed.

* ``trainer``: ``Trainer``, the in-memory trainer (data order, augmentation noise, optimiser and schedule, caption
  bank, gradient sync, per-epoch diagnostics); it drives a defense (:mod:`..defenses`) through ``TrainerView``.
* ``augment``: image translation/brightness and caption word dropout.
* ``slots``: the worker side of a stream: a rank's slots of a source as minibatches.
* ``stream``: ``StreamTrainer``, the trainer over a stream, window by window, DDP-ready (ranks own slots).

Multi-process training (torchrun, DDP) goes through ``reprlab.train.dist``: the trainers split every global batch
across ranks and gather what the defenses need, so a new launcher or sharding scheme belongs there or here.
"""
