"""Benchmark plumbing: datasets, the Hugging Face transformers peer, and result recording."""
