"""Built-in tasks: arithmetic prompts (arithmetic) and example rewards (rewards), the defaults of
``data.path`` and ``rewards.specs``."""
