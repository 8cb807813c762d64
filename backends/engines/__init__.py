"""Real engines beside kvpool: their virtual environments, a tiny local model, and drivers that run one
engine instance against the pool and report its tokens and cache counters (tests and `kvpool bench engines`)."""
