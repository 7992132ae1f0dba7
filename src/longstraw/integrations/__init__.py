"""Drop-in integrations with other RL trainers (optional extras; nothing here is imported by ``longstraw``).

* :mod:`longstraw.integrations.trl`: ``LongStrawGRPOTrainer``, TRL's ``GRPOTrainer`` with the policy loss and its
  gradients computed by :func:`longstraw.grpo_backward` (``pip install longstraw[trl]``).
"""
