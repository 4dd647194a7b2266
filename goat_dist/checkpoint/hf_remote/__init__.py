"""Sources copied into a Hugging Face export for ``trust_remote_code``; not imported by goat-dist itself."""
