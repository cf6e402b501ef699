"""``openinfer serve``: an OpenAI-compatible HTTP server around one ``LLMEngine`` driven from its own
thread."""
