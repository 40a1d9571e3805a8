"""Pieces several domains share: layer ids, the target's shape, atomic files, hub paths, charts."""
