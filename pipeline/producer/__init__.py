"""The producer side: the vLLM engine builder (engine), the producer loop that admits, generates,
scores and sends GRPO groups and runs the sync barrier (loop), its on-disk outbox of unacknowledged
groups (outbox), the reward runner and its Python API (rewards), and prompt data (data)."""
