"""Drafters: the sources of candidate tokens (model, ngram, adjacency)."""
