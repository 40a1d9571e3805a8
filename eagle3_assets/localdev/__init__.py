"""The miniature world: a tiny offline tokenizer, two tiny target LLMs and a prompt pool."""
