"""Prompts and tokenizers."""
