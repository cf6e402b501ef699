"""Image input, before the engine: decoding and checking an image (``image_io``), DeepSeek-V4.1's resize /
token-layout rule (``image_layout``), and placing the image tokens in a prompt (``processor``). No torch here:
the engine core carries what this produces (``step_io.MMImage``) as plain data."""
