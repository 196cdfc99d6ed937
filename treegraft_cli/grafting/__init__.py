"""TreeGraft (DESIGN.md §4): a weak n-gram drafter and a strong model drafter growing one shared tree.

``config`` the method settings · ``tree_ops`` rescoring, grafting positions and the final cut ·
``scheduler`` the 17 state features, the cost model and the call policies · ``costs`` the warm-up cost
measurement · ``builder`` the layer loop.
"""
