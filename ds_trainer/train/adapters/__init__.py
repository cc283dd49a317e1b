"""What trains: the whole model, LoRA adapters on it, and the text encoders that train with it."""
