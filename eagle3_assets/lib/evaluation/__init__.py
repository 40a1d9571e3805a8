"""Acceptance measured in vLLM, before and after."""
