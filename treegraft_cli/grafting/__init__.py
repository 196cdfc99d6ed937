"""TreeGraft's shared tree (DESIGN.md §4): a weak n-gram drafter and a strong model drafter growing one tree.

``config`` the method settings · ``tree_ops`` capped scores, grafting positions and the final cut ·
``builder`` the layer loop. When to call the strong drafter is ``scheduling``'s.
"""
