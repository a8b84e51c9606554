"""Hugging Face Accelerate's API on the Engine: `Accelerator` and the verbs an Accelerate loop calls."""
