"""The learner side: the learner loop that receives groups, trains and publishes versions (loop),
the optimiser step (trainer), the GRPO loss (loss), checkpoints (checkpoint), multi-rank learners
(distributed, main) and metrics (metrics)."""
