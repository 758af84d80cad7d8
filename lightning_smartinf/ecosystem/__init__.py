"""What the package knows of other libraries' models (Hugging Face transformers, litgpt): Lightning-free, and
importable without those libraries installed."""
