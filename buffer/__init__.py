"""Rollout buffer package: wire schema (schema), the RolloutBuffer (store), the ZeroMQ transport
(transport) and its benchmark (bench). Knows nothing of sync/ or pipeline/; import the
submodules directly (nothing is imported here, so `import buffer` stays cheap)."""
