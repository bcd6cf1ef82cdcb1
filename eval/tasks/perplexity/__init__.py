"""Teacher-forced perplexity, KL divergence, top-1 agreement, greedy continuation and K/V error on text windows."""
