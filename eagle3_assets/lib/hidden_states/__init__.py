"""Hidden states: exact token sequences, the two extraction backends, shards."""
