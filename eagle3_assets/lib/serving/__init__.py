"""Starting, stopping and probing vLLM servers."""
