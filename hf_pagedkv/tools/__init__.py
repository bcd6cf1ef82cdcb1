"""Tools around the cache: capacity planner, CLI, model loading, consistency checks."""
