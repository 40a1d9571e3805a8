"""The drafter checkpoint: download, the one reader and validator, the vLLM export."""
