"""Chat encoders for checkpoints that ship Python, not a Jinja template (DeepSeek-V4): messages -> prompt text,
rendered exactly as the model's published encoder does."""
